"""DFlash's network: a small block drafter whose every layer reads the target's context
through injected K/V, and its training loss.

Owns: `DFlashNet` (implements `learned.DraftNet`) and its `DFlashNetConfig`; the K/V
injection (`context_kv`), the one-pass block forward (`block_logits`), and
`training_loss` with `ContextKV`, the differentiable cache that lets a training
forward run through the same `Transformer.forward` as decoding.
Does not own: per-request state, sampling or the engine contract (dflash.py), or
the training loop (specdecode/train/).

Shape. ``num_layers`` transformer blocks of the target's width and attention heads
(own MLP width), run by our one `Transformer`, which borrows the target's token
embedding and LM head (frozen, not saved). The features of a few target layers
(`hidden_layers`, low to high) are concatenated, fused by ``fc`` to the hidden width
and normed: ``c_t`` for each committed token t. Every drafter layer's context keys and
values are that layer's own k / v projections of ``c_t`` (RoPE at position t): KV
injection, so the drafter sees the target's context at every depth for the price of
two projections per token and layer.

The block. With ``L`` committed tokens and features for the first ``L - 1``, the block
is ``[token L-1 (the root), MASK × (S - 1)]`` at positions ``L-1 .. L-2+S`` (S = the
block size; MASK is a learned vector). It attends to every context K/V and to the
whole block (bidirectional); block position j's output, through the final norm and the
target's LM head, is the draft distribution of token ``L + j``. The whole block always
runs, whatever γ ≤ S is used, so decoding sees exactly what training did.

Training (`training_loss`): ``anchors_per_window`` anchors a per window at generated answer
tokens (drawn at random over the batch's in training, evenly spread over each window's in
evaluation); the block rooted at token a sees the context features of tokens < a and is trained by soft
cross-entropy against the target's own distributions of tokens a+1 .. a+S, position j
weighted by ``exp(-j / position_decay)`` (early positions matter most: a draft token
counts only if all before it were accepted). Each (window, anchor) pair is a row of one
forward pass over `ContextKV`: the row's cached length is its anchor, so the row sees
exactly the context before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.config import SpecDecodeError, is_int
from specdecode.drafters.draft_vocab import Borrowed, DraftVocabHead
from specdecode.drafters.learned import TrainBatch
from specdecode.cache.kv_cache import KVCache
from specdecode.model.masks import FULL
from specdecode.model.transformer import RMSNorm, Transformer, apply_rope

ACC_POSITIONS = (1, 2, 3, 4, 8, 16)  # acc@k reported for these k (those within the block)


@dataclass(frozen=True)
class DFlashNetConfig:
    """The net's shape (and its training objective, saved with it)."""

    num_layers: int = 2
    block_size: int = 16  # S: draft tokens one pass can propose (γ ≤ S)
    intermediate_size: int | None = None  # MLP width; None = a third of the target's
    num_target_layers: int = 3  # target layers fused into the context features, spread low to high
    draft_vocab: int = 8192  # LM head rows kept (draft_vocab.py); 0 = the whole vocabulary
    anchors_per_window: int = 8  # training: blocks per corpus window in one forward
    position_decay: float | None = 7.0  # training: weight exp(-j / decay) at block position j; None = uniform

    def __post_init__(self) -> None:
        if not is_int(self.draft_vocab) or self.draft_vocab < 0:
            raise SpecDecodeError(f"dflash net draft_vocab must be an integer >= 0, got {self.draft_vocab!r}")
        for name in ("num_layers", "block_size", "num_target_layers", "anchors_per_window"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise SpecDecodeError(f"dflash net {name} must be a positive integer, got {value!r}")
        if self.block_size > 64:
            raise SpecDecodeError(f"dflash net block_size must be at most 64, got {self.block_size}")
        size = self.intermediate_size
        if size is not None and (not is_int(size) or size < 1):
            raise SpecDecodeError(f"dflash net intermediate_size must be a positive integer or null, got {size!r}")
        decay = self.position_decay
        if decay is not None and (not isinstance(decay, (int, float)) or isinstance(decay, bool) or decay <= 0):
            raise SpecDecodeError(f"dflash net position_decay must be a positive number or null, got {decay!r}")


def spread_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """``count`` target layers spread evenly from the second to the second-last (as DFlash
    does: the last layers are too specialised to the next token alone), deduplicated."""
    lo, hi = min(1, num_layers - 1), max(num_layers - 2, 0)
    if count == 1:
        return (hi,)
    picks = [round(lo + i * (hi - lo) / (count - 1)) for i in range(count)]
    return tuple(sorted(set(picks)))


class ContextKV(KVCache):
    """A differentiable stand-in for the drafter's cache in training: row r holds the
    injected context K/V ``kv[layer]`` ([R, Hkv, C, D], C ≥ lengths.max() + block) of
    which its first ``lengths[r]`` slots are visible; `append` scatters the block's own
    K/V after them out of place, so autograd flows into both."""

    def __init__(self, kv: list[tuple[Tensor, Tensor]], lengths: Tensor) -> None:
        self.kv = kv
        self.lengths = lengths

    def append(self, layer: int, k: Tensor, v: Tensor, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        ck, cv = self.kv[layer]
        index = slots[:, None, :, None].expand_as(k)  # [R, Hkv, T, D]
        return ck[:, :, :kv_len].scatter(2, index, k), cv[:, :, :kv_len].scatter(2, index, v)

    def commit(self, num_tokens: Tensor) -> None:
        raise RuntimeError("ContextKV is a training forward's; it keeps nothing")

    def truncate(self, lengths: Tensor) -> None:
        raise RuntimeError("ContextKV is a training forward's; it keeps nothing")

    def keep_slots(self, row: int, src_slots: Tensor, dst_start: int) -> None:
        raise RuntimeError("ContextKV is a training forward's; it keeps nothing")

    def select_rows(self, rows: Tensor) -> None:
        raise RuntimeError("ContextKV is a training forward's; it keeps nothing")


class DFlashNet(nn.Module):
    """The block drafter (see the module docstring). Build with `from_target`."""

    Config: ClassVar[type] = DFlashNetConfig
    method: ClassVar[str] = "dflash"
    # not saved: the body's placeholder embedding and the head rows rebuilt from the target's
    BORROWED: ClassVar[tuple[str, ...]] = ("body.embed.", "body.lm_head.linear.")

    def __init__(self, config: DFlashNetConfig, target: Transformer) -> None:
        super().__init__()
        self.config = config
        tcfg = target.config
        self.hidden_layers: tuple[int, ...] = spread_layers(tcfg.num_layers, config.num_target_layers)
        H = tcfg.hidden_size
        weight = target.embed.weight
        device, dtype = weight.device, weight.dtype
        body_cfg = dataclasses.replace(
            tcfg,
            vocab_size=1,  # the body reads embeddings given to it; the target embeds the roots
            num_layers=config.num_layers,
            intermediate_size=config.intermediate_size or max(1, tcfg.intermediate_size // 3),
            layer_types=(),  # every layer full attention: the block must see the whole context
            sliding_window=None,
            local_rope=None,
        )
        with torch.device("meta"):
            body = Transformer(body_cfg)
        body.layers.to_empty(device=device).to(dtype)
        body.norm.to_empty(device=device).to(dtype)
        body.embed = nn.Embedding(1, H, device=device, dtype=dtype).requires_grad_(False)  # dtype, device
        body.lm_head = DraftVocabHead(target, config.draft_vocab)
        body.to(device)  # the RoPE tables
        self.body = body
        self.borrowed = Borrowed(target)  # outside the module tree: never trained, saved or cast
        self.fc = nn.Linear(len(self.hidden_layers) * H, H, bias=False, device=device, dtype=dtype)
        self.context_norm = RMSNorm(H, tcfg.rms_norm_eps, tcfg.norm_offset).to(device=device, dtype=dtype)
        self.mask_embed = nn.Parameter(torch.zeros(H, device=device, dtype=dtype))
        self._init_weights(target)

    @torch.no_grad()
    def _init_weights(self, target: Transformer) -> None:
        """Linears as PyTorch initialises them (uniform, ±1/√fan_in), unit norms (zero under
        Gemma's 1 + w), the target's final norm, a small MASK vector."""
        for module in [*self.body.layers.modules(), self.fc, self.context_norm]:
            if isinstance(module, nn.Linear):
                module.reset_parameters()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0 if module.offset == 0 else 0.0)
        self.body.norm.weight.copy_(target.norm.weight)
        nn.init.normal_(self.mask_embed, std=0.02)

    @classmethod
    def from_target(cls, config: DFlashNetConfig, target: Transformer) -> DFlashNet:
        return cls(config, target)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def head(self) -> DraftVocabHead:
        return self.body.lm_head

    def prepare(self, token_counts: Tensor) -> None:
        """Keep the ``draft_vocab`` most frequent tokens of the training corpus (counts [V])."""
        self.head.prepare(token_counts)

    def saved_state(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.BORROWED)}

    # ---- the forward pieces decoding and training share ----------------------------------

    def context_kv(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Injected K/V of committed tokens: features [B, N, F] (the target's ``hidden_layers``,
        concatenated) at positions [B, N] -> per drafter layer (k, v), each [B, Hkv, N, D]."""
        c = self.context_norm(self.fc(features.to(self.context_norm.weight.dtype)))  # [B, N, H]
        B, N, _ = c.shape
        rope = self.body.rope_tables(FULL, positions, c.dtype)
        out = []
        for layer in self.body.layers:
            attn = layer.attn
            # k and v follow q in the fused projection's outputs; the whole projection runs (its q
            # part is a few unused columns per committed token) so quantized linears work too
            first = attn.heads * attn.head_dim
            kv = attn.qkv(c)[..., first:].reshape(B, N, 2 * attn.kv_heads, attn.head_dim)
            k, v = kv.split(attn.kv_heads, dim=2)  # [B, N, Hkv, D] each
            if attn.qk_norm:
                k = attn.k_norm(k)
            k = apply_rope(k, *rope)
            out.append((k.transpose(1, 2), v.transpose(1, 2)))
        return out

    def block_logits(self, roots: Tensor, cache: KVCache, logits_at: Tensor | None = None) -> Tensor:
        """Logits [B, S or K, V] (fp32) of the block ``[root, MASK × (S-1)]`` of each row, placed
        right after its cached context (its root at position ``cache.lengths``). Writes the
        block's K/V past each row's length (scratch: never committed). roots [B] int64;
        logits_at [B, K]: the block positions to return (None: all S)."""
        S, B = self.block_size, roots.shape[0]
        cfg = self.body.config
        root = self.borrowed.target.embed(roots).to(self.mask_embed.dtype)  # [B, H]
        if cfg.embed_scale != 1.0:
            root = root * root.new_tensor(cfg.embed_scale)
        mask = self.mask_embed.expand(B, S - 1, -1)
        embeds = torch.cat([root[:, None].to(mask.dtype), mask], dim=1)  # [B, S, H]
        positions = cache.lengths[:, None] + torch.arange(S, device=roots.device)  # [B, S]
        block_mask = torch.ones(B, S, S, dtype=torch.bool, device=roots.device)  # bidirectional within the block
        return self.body(None, positions, cache, block_mask=block_mask, logits_at=logits_at, embeds=embeds)

    # ---- training ------------------------------------------------------------------------

    def anchor_logits(self, tokens: Tensor, hidden: Tensor, rows: Tensor, anchors: Tensor) -> Tensor:
        """Differentiable block logits [R, S, V] for R blocks over B windows at once: block r
        is rooted at token ``anchors[r]`` of window ``rows[r]`` and sees the context features of
        that window's tokens before it. tokens [B, T] int64; hidden [B, T, F]; rows, anchors [R]."""
        B, T = tokens.shape
        S = self.block_size
        # the context: every window's features, injected once, then each row's window picked
        positions = torch.arange(T + S, device=tokens.device).expand(B, -1)
        features = F.pad(hidden, (0, 0, 0, S))  # [B, T + S, F]: room for the block's slots
        kv = [(k[rows], v[rows]) for k, v in self.context_kv(features, positions)]  # [R, Hkv, T + S, D]
        return self.block_logits(tokens[rows, anchors], ContextKV(kv, anchors))

    def training_loss(self, batch: TrainBatch) -> tuple[Tensor, dict[str, float]]:
        S, K = self.block_size, self.config.anchors_per_window
        tokens, mask = batch.tokens, batch.mask  # [B, T]
        B, T = tokens.shape
        device = tokens.device
        roots = mask & F.pad(mask[:, :-1], (1, 0))  # token a was predicted at a - 1: generated, not given
        rows, anchors = self._anchors(roots, K)  # [R] window and anchor of each row
        logits = self.anchor_logits(tokens, batch.hidden, rows, anchors)  # [R, S, V]
        # targets: the target's distributions of tokens a+1 .. a+S, logits[:, a + j]
        at = anchors[:, None] + torch.arange(S, device=device)  # [R, S]
        valid = (at < T) & mask[rows[:, None], at.clamp(max=T - 1)] & roots[rows, anchors][:, None]  # [R, S]
        valid = valid.long().cumprod(dim=1).bool()  # labels up to a gap only: no block across a user turn
        where = (rows[:, None], at.clamp(max=T - 1))
        p = batch.probs_at(self.head.vocab_ids, where)  # [R, S, Vd]
        log_q = torch.log_softmax(logits, dim=-1)
        ce = -(p * log_q).sum(dim=-1)  # [R, S]
        decay = self.config.position_decay
        j = torch.arange(S, device=device, dtype=torch.float32)
        weight = torch.exp(-j / decay) if decay is not None else torch.ones_like(j)
        w = weight[None, :] * valid.float()  # [R, S]
        loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
        return loss, self._metrics(p, batch.argmax()[where], logits.detach(), valid)

    def _anchors(self, roots: Tensor, K: int) -> tuple[Tensor, Tensor]:
        """rows [R], anchors [R] (R = B·K): blocks rooted where ``roots`` [B, T] (trained positions
        whose token is itself a label: serving roots a block at a generated token, never at the
        prompt's last). Training draws them at random over the whole batch, distinct where there
        are enough, so every label is as likely (K per window would repeat a short answer's);
        evaluation spreads K over each window's, so held-out figures compare like with like.
        (With no root anywhere the anchors are arbitrary; the loss masks them.)"""
        B, T = roots.shape
        if not self.training:
            count = roots.sum(dim=1, keepdim=True)  # [B, 1]
            nth = ((torch.arange(K, device=roots.device) + 0.5) * count / K).long()  # [B, K]: the nth root
            at = torch.searchsorted(roots.long().cumsum(dim=1), nth + 1).clamp(max=T - 1)  # (none: any, all masked)
            return torch.arange(B, device=roots.device).repeat_interleave(K), at.reshape(-1)
        weights = roots.flatten().float()  # [B·T]
        n = int(weights.sum())
        if n == 0:  # nothing to learn: any anchors, all masked
            weights, n = torch.ones_like(weights), B * T
        picked = torch.multinomial(weights, B * K, replacement=B * K > n)  # [R]
        return picked // T, picked % T

    @torch.no_grad()
    def _metrics(self, p: Tensor, greedy: Tensor, q_logits: Tensor, valid: Tensor) -> dict[str, float]:
        """acc@k (top-1 agreement at block position k), alpha@1 (Σ min(p, q) at the first),
        tau_greedy (1 + the leading agreements: tokens per round under greedy, were S drafted)."""
        S = valid.shape[1]
        agree = (greedy == self.head.vocab_ids[q_logits.argmax(-1)]) & valid  # [R, S]
        metrics: dict[str, float] = {}
        for k in ACC_POSITIONS:
            if k <= S:
                n = valid[:, k - 1].sum().clamp_min(1)
                metrics[f"acc@{k}"] = float(agree[:, k - 1].sum() / n)
        first = valid[:, 0]
        overlap = torch.minimum(p[:, 0], torch.softmax(q_logits[:, 0], -1)).sum(-1)  # [R]
        metrics["alpha@1"] = float((overlap * first).sum() / first.sum().clamp_min(1))
        leading = agree.long().cumprod(dim=1).sum(dim=1).float()  # [R]
        metrics["tau_greedy"] = 1.0 + float(leading.mean())
        return metrics
