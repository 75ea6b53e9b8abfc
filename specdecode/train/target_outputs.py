"""The frozen target's outputs that a drafter's net trains on: features and soft labels.

Owns: one batch of windows run through the target (`target_batch`: features and whole
logits), the chunked top-k variant (`target_top`), and `TargetCache`, which keeps each
window's features (bf16) and top-k logits after its first use, so that the target runs
the first epoch only. Everything runs under inference mode and is copied out, so the
net's autograd sees plain constants.
Does not own: the training loop (trainer.py), `TrainBatch` and its soft labels
(drafters/learned.py), the windows (corpus.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.drafters.learned import TrainBatch, label_rows
from specdecode.cache.kv_cache import NoCache
from specdecode.model.transformer import Transformer
from specdecode.train.corpus import Windows


def target_batch(target: Transformer, tokens: Tensor, mask: Tensor, hidden_layers: tuple[int, ...]) -> TrainBatch:
    """The frozen target's features (fp32) and logits for a batch of windows; ``mask`` [B, T]:
    the positions trained on (`Windows.trained`)."""
    device = target.embed.weight.device
    tokens, mask = tokens.to(device), mask.to(device)
    B, T = tokens.shape
    positions = torch.arange(T, device=device).expand(B, T)
    with torch.inference_mode():  # cheaper than no_grad: no version counters or view tracking
        out = target(tokens, positions, NoCache(B, device), hidden_layers=hidden_layers)
        if hidden_layers:
            logits, hidden = out[0], torch.cat(out[1], dim=-1)
        else:
            logits, hidden = out, torch.zeros(B, T, 0, device=device)
    # copies made outside inference mode are plain tensors, which autograd may read
    logits, hidden = logits.clone(), hidden.float() if hidden.dtype != torch.float32 else hidden.clone()
    return TrainBatch(tokens=tokens, hidden=hidden, logits=logits, mask=mask, target=target)


class TargetCache:
    """Each training window's target outputs after its first use: features (bf16) and top-k
    logits, kept in arrays made once for every window, whose pages are taken as they are filled.
    (A tensor per window, each allocated among a step's transient buffers, fragments the heap:
    a long run then holds several times its data in memory.)"""

    def __init__(self, topk: int, windows: Windows, width: int, device: torch.device) -> None:
        """For the training ``windows``; ``width``: the features' size (the net's hidden layers
        times the target's hidden size)."""
        N, T = windows.tokens.shape
        self.topk, self.windows = topk, windows
        self.filled = torch.zeros(N, dtype=torch.bool)
        self.hidden = torch.empty(N, T, width, dtype=torch.bfloat16, device=device)  # pages taken as filled
        self.values = torch.empty(N, T, topk, dtype=torch.float32, device=device)
        self.indices = torch.empty(N, T, topk, dtype=torch.int32, device=device)

    def batch(self, target: Transformer, rows: Tensor, hidden_layers: tuple[int, ...]) -> TrainBatch:
        """The windows ``rows`` [B] (indices into the cache's windows), run through the target if new."""
        windows = self.windows
        missing = rows[~self.filled[rows]].unique()  # (a batch across two epochs may repeat a window)
        if len(missing):
            hidden, values, indices = target_top(target, windows.tokens[missing], hidden_layers, self.topk,
                                                 mask=windows.trained[missing])  # fmt: skip
            at = missing.to(self.hidden.device)
            self.hidden[at], self.values[at] = hidden.to(torch.bfloat16), values
            self.indices[at] = indices.to(torch.int32)
            self.filled[missing] = True
        at = rows.to(self.hidden.device)
        device = target.embed.weight.device
        return TrainBatch(tokens=windows.tokens[rows].to(device), hidden=self.hidden[at].float(), logits=None,
                          mask=windows.trained[rows].to(device), target=target,
                          top=(self.values[at], self.indices[at]))  # fmt: skip


def target_top(
    target: Transformer, tokens: Tensor, hidden_layers: tuple[int, ...], k: int, chunk: int = 128,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The frozen target's features [B, T, F] (fp32) and its k largest logits per position (values
    fp32, token ids; [B, T, k] each), the LM head run ``chunk`` positions at a time: [B, T, V] fp32
    logits would be hundreds of MB for a batch of long windows (and faulting in fresh pages for
    them can cost more than the head's arithmetic). With ``mask`` [B, T] the head runs only where
    it is True (the trained positions: every net reads its labels there, and in chat windows
    they are ~1/4 of the tokens, the head ~1/5 of the target's pass); elsewhere the values are 0
    over token ids 0..k-1, a placeholder that no loss reads."""
    device = target.embed.weight.device
    tokens = tokens.to(device)
    B, T = tokens.shape
    positions = torch.arange(T, device=device).expand(B, T)
    none = torch.zeros(B, 0, dtype=torch.long, device=device)  # the forward's own head runs on no position
    with torch.inference_mode():
        _, hiddens = target(tokens, positions, NoCache(B, device), logits_at=none, hidden_layers=(*hidden_layers, -1))
        final = hiddens[-1].reshape(B * T, -1)  # [B·T, H] final-normed
        at = label_rows(torch.ones(B, T, dtype=torch.bool) if mask is None else mask, chunk).to(device)
        values = torch.zeros(B * T, k, device=device)
        indices = torch.arange(k, device=device).repeat(B * T, 1)
        for i in range(0, len(at), chunk):
            top = target.head_logits(final[at[i : i + chunk]]).topk(k, dim=-1)
            values[at[i : i + chunk]], indices[at[i : i + chunk]] = top.values.float(), top.indices
        hidden = torch.cat(hiddens[:-1], dim=-1) if hidden_layers else final.new_zeros(B, T, 0)
        hidden = hidden.float()
    # copies made outside inference mode are plain tensors, which autograd may read
    return hidden.clone(), values.reshape(B, T, k).clone(), indices.reshape(B, T, k).clone()
