"""The target's LM head restricted to a draft vocabulary (EAGLE-3's reduced head), shared
by the learned drafters whose draft step would otherwise be dominated by the full head.

Owns: `DraftVocabHead`: which target tokens a net may draft (``vocab_ids``, chosen from
the training corpus's token counts by `prepare`, saved with the net) and the head rows
for them, rebuilt from the target's LM head whenever the ids change (never saved).
For SmolLM2 (V = 49,152, hidden 576) an 8,192-token head costs a sixth of the full one.
A drafter's q is 0 outside the draft vocabulary, so verification stays exact: those
tokens are never drafted, only emitted by the target.

Also owns the confidence stop the learned chain drafters share (``confidence_threshold``):
each draft token's own probability under the head (`DraftVocabHead.own_probability`) and
the cut after the first unsure one (`stop_after_unsure`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor, nn

from specdecode.config import SpecDecodeError
from specdecode.model.transformer import Transformer
from specdecode.core.logits_process import process_logits
from specdecode.core.sampling import argmax, logits_to_probs, sample

if TYPE_CHECKING:
    from specdecode.core.batch import Batch


@dataclass(frozen=True)
class Borrowed:
    """The target, held outside the module tree: its weights are neither trained, saved nor cast."""

    target: Transformer


class DraftVocabHead(nn.Module):
    """x [..., H] -> draft-vocabulary logits [..., Vd]; ``sample`` draws from them and maps
    tokens and q onto the whole vocabulary."""

    def __init__(self, target: Transformer, size: int) -> None:
        super().__init__()
        V, H = target.config.vocab_size, target.config.hidden_size
        size = min(size or V, V)  # 0, or more than the target has: the whole vocabulary
        self.borrowed = Borrowed(target)
        self.register_buffer("vocab_ids", torch.arange(size, device=target.norm.weight.device))
        dtype = target.norm.weight.dtype
        self.linear = nn.Linear(H, size, bias=False, device=target.norm.weight.device, dtype=dtype)
        self.linear.requires_grad_(False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module.rebuild())
        self.rebuild()

    @property
    def size(self) -> int:
        return int(self.vocab_ids.shape[0])

    @torch.no_grad()
    def rebuild(self) -> None:
        """The rows of ``vocab_ids`` from the target's LM head, whatever kind of linear it is."""
        target = self.borrowed.target
        eye = torch.eye(self.linear.in_features, dtype=target.norm.weight.dtype, device=self.vocab_ids.device)
        rows = target.project_vocab(eye).T[self.vocab_ids]  # [Vd, H]
        self.linear.weight.copy_(rows.to(self.linear.weight))

    @torch.no_grad()
    def prepare(self, token_counts: Tensor) -> None:
        """Keep the most frequent tokens (counts [V] over the training corpus)."""
        ids = token_counts.float().topk(self.size).indices.sort().values
        self.vocab_ids.copy_(ids.to(self.vocab_ids))
        self.rebuild()

    def forward(self, x: Tensor) -> Tensor:
        w = self.linear.weight  # a quantized linear (packed integer weight) casts by itself
        return self.linear(x.to(w.dtype) if w.is_floating_point() else x)

    def sample(
        self, logits: Tensor, batch: Batch, vocab_size: int, start: int = 0, drafting: Tensor | None = None,
        states: list | None = None, prior: list[list[int]] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Draft tokens [B, T] sampled from ``logits`` [B, T, Vd] (draft positions start .. start+T-1)
        under the rows' temperature, top-k and top-p, and their q [B, T, V] (0 outside the draft
        vocabulary). Computed over the draft vocabulary and then scattered: the same distribution
        as filtering the full logits (-inf outside; ``vocab_ids`` are sorted, so argmax ties break
        alike), at a sixth of the cost of the softmax and of the random draws. Rows past their
        draft limit, or not ``drafting`` [B], draw from scratch (`Batch.draft_generators`).
        With ``states`` (logits_process.row_states), each position's logits are first processed
        as plain decoding processes p (penalties, masks, grammar), seeing ``prior`` [B] (the
        row's drafts before ``start``) and the tokens drawn before it: likelier drafts."""
        if states is not None:
            q, draws = self._processed_q(logits, batch, vocab_size, start, drafting, states, prior)
        else:
            q = logits_to_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)  # [B, T, Vd]
            draws = [sample(q[:, k], batch.draft_generators(start + k, drafting)) for k in range(q.shape[1])]
        tokens = self.vocab_ids[torch.stack(draws, dim=1)]
        if self.size == vocab_size:  # the whole vocabulary: vocab_ids, kept sorted by prepare, is every id in order
            return tokens, q
        full = q.new_zeros((*q.shape[:-1], vocab_size))
        return tokens, full.scatter_(-1, self.vocab_ids.expand(*q.shape[:-1], -1), q)  # [B, T], [B, T, V]

    def greedy(
        self, logits: Tensor, vocab_size: int, states: list | None, prior: list[list[int]] | None = None
    ) -> Tensor:
        """Greedy draft tokens [B, T] from ``logits`` [B, T, Vd]: the argmax, or with ``states``
        the argmax of each position's logits processed as plain decoding processes p (over the
        full vocabulary, with ``prior`` and the tokens chosen before it)."""
        if states is None:
            return self.vocab_ids[argmax(logits)]
        draws = self._by_position(logits, vocab_size, states, prior, lambda k, x: argmax(x))
        return self.vocab_ids[torch.stack(draws, dim=1)]

    def _processed_q(self, logits: Tensor, batch: Batch, vocab_size: int, start: int, drafting: Tensor | None,
                     states: list, prior: list[list[int]] | None) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
        """q [B, T, Vd] and the draws [T of [B]], position by position, drawn as `sample` draws."""
        qs: list[Tensor] = []

        def draw(k: int, x: Tensor) -> Tensor:
            q_k = logits_to_probs(x[:, None], batch.temperature, batch.top_k, batch.top_p, batch.min_p)[:, 0]
            qs.append(q_k)
            return sample(q_k, batch.draft_generators(start + k, drafting))

        draws = self._by_position(logits, vocab_size, states, prior, draw)
        return torch.stack(qs, dim=1), draws

    def _by_position(self, logits: Tensor, vocab_size: int, states: list, prior: list[list[int]] | None,
                     pick: Callable[[int, Tensor], Tensor]) -> list[Tensor]:  # fmt: skip
        """Position k's logits [B, Vd] processed over the full vocabulary (logits_process), seeing
        ``prior`` and the tokens picked before k; ``pick(k, x)`` chooses from the processed x
        [B, Vd] an index into the draft vocabulary per row. Returns the indices [T of [B]]."""
        B, T, _ = logits.shape
        ids = self.vocab_ids
        chosen = [list(prior[b]) if prior else [] for b in range(B)]
        draws: list[Tensor] = []
        for k in range(T):
            full = logits.new_full((B, vocab_size), float("-inf"), dtype=torch.float32)
            full[:, ids] = logits[:, k].float()
            draw = pick(k, process_logits(full, range(B), chosen, states)[:, ids])  # [B]
            draws.append(draw)
            chosen = [c + [t] for c, t in zip(chosen, ids[draw].tolist())]
        return draws

    def own_probability(self, logits: Tensor, tokens: Tensor, q: Tensor | None, batch: Batch) -> Tensor:
        """[B, T] the draft's probability of its tokens [B, T] (logits [B, T, Vd]; q [B, T, V] or
        None): q(d) where a row samples, the softmax at T = 1 where it is greedy (its q is one-hot)."""
        index = torch.searchsorted(self.vocab_ids, tokens.clamp(min=0))  # vocab_ids are sorted; -1: any
        own = logits.float().softmax(-1).gather(-1, index[..., None])[..., 0]
        if q is None:
            return own
        return torch.where((batch.temperature == 0)[:, None], own, q.gather(-1, tokens.clamp(min=0)[..., None])[..., 0])


def check_confidence_threshold(h: object) -> None:
    """``confidence_threshold`` (learned chain and block drafters): a number in [0, 1)."""
    if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
        raise SpecDecodeError(f"confidence_threshold must be a number in [0, 1), got {h!r}")


def stop_after_unsure(tokens: Tensor, own: Tensor, threshold: float) -> Tensor:
    """Chains [B, T] cut after their first token whose own probability [B, T] is below
    ``threshold`` (that token stays, as Hugging Face's assistant_confidence_threshold keeps it);
    -1 past the cut."""
    sure = (own >= threshold).long()
    keep = torch.cat([torch.ones_like(sure[:, :1]), sure[:, :-1].cumprod(dim=1)], dim=1)  # all before k sure
    return torch.where(keep.bool(), tokens, -1)
