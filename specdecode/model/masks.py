"""Attention masks: which keys each query of a forward pass may see.

Owns: the boolean SDPA masks per layer type (full and sliding-window) for causal chains,
draft trees (a node sees only its ancestors) and batches whose rows have different cached
lengths, the per-query key lists of batch-invariant mode, and how many queries a padded
pass's attention computes (`attention_queries`: padded, or split when few rows draft).
Does not own: attention itself or the cache layout (transformer.py, kv_cache.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specdecode.model.model_config import ModelConfig

FULL, SLIDING = "full", "sliding"


def attention_masks(
    cfg: "ModelConfig", positions: Tensor, lengths: Tensor, block_mask: Tensor | None, kv_len: int
) -> dict[str, Tensor | None]:
    """Boolean SDPA masks [B, 1, G*T, kv_len] per layer type (the query rows of a kv head's
    G heads folded together); None = no mask (T == 1, or causal over an empty cache)."""
    B, T = positions.shape
    window = cfg.sliding_window
    # Every query position is < kv_len, so a window of at least kv_len hides nothing.
    use_window = window is not None and SLIDING in cfg.layer_types and kv_len > window
    simple = B == 1 and block_mask is None and (T == 1 or kv_len == T)
    if simple and not use_window:
        return {FULL: None, SLIDING: None}
    device = positions.device
    j = torch.arange(kv_len, device=device)
    s = j[None, :] - lengths[:, None]  # [B, S]: slot offset into this pass (< 0: cached)
    t = torch.arange(T, device=device)[None, :, None]
    if block_mask is None:
        visible = s[:, None, :] <= t  # [B, T, S]
    else:
        picked = block_mask.to(torch.bool).gather(2, s.clamp(0, T - 1)[:, None, :].expand(B, T, kv_len))
        own = s[:, None, :] == t  # a query always sees itself, so no row is fully masked
        visible = (s < 0)[:, None, :] | ((s < T)[:, None, :] & picked) | own
    group = cfg.num_heads // cfg.num_kv_heads
    fold = lambda m: m[:, None].repeat(1, 1, group, 1)  # noqa: E731  [B, 1, G*T, S], rows (g, t)
    masks = {FULL: None if simple else fold(visible), SLIDING: None}
    if SLIDING in cfg.layer_types:
        if use_window:
            new_pos = positions.gather(1, s.clamp(0, T - 1))
            key_pos = torch.where(s < 0, j[None, :], new_pos)  # cached slot == position
            near = positions[:, :, None] - key_pos[:, None, :] < window
            masks[SLIDING] = fold(visible & near)
        else:
            masks[SLIDING] = masks[FULL]
    return masks


def visible_keys(mask: Tensor | None, lengths: Tensor, T: int) -> list[list[Tensor | slice]]:
    """Key slots per query (b, t), ascending: from the folded mask (row t is group 0's), or causal.
    A contiguous run is returned as a slice, so chains read the cache without a gather."""
    if mask is None:
        ends = (lengths[:, None] + torch.arange(T, device=lengths.device) + 1).tolist()
        return [[slice(0, e) for e in row] for row in ends]

    def keys(row: Tensor) -> Tensor | slice:
        idx = row.nonzero()[:, 0]
        first, last = int(idx[0]), int(idx[-1])
        return slice(first, last + 1) if last - first + 1 == idx.numel() else idx

    return [[keys(mask[b, 0, t]) for t in range(T)] for b in range(mask.shape[0])]


def attention_queries(rows: int, drafting: int, width: int) -> int:
    """Queries (per head) that attention computes in a pass of ``rows`` padded to ``width``
    tokens, ``drafting`` of them holding more than one: B·T padded, or B + R·(T−1) when that
    is at most a third as many, in which case `Transformer.forward` splits attention that way.
    (Splitting copies the drafting rows' K/V and runs a second SDPA, which pays only where few
    rows draft wide: with many rows drafting a little, the copy and the second call cost more
    than the padding saves.)"""
    split = rows + drafting * (width - 1)
    return split if drafting > 0 and split <= rows * width // 3 else rows * width


def split_plan(
    valid: Tensor, masks: dict[str, Tensor | None], group: int
) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]] | None:
    """How a packed pass (``valid`` [B, T]) splits its attention, or None when it stays padded.

    Attention runs on the batch padded to its widest row (B·T queries), so a few deep rows
    in a busy batch make every row pay for their width; split, only the drafting rows do.
    Returns the drafting rows [R] and, per layer kind, the folded mask's rows for every row's
    first query [B, 1, G, S] and for the drafting rows' later queries [R, 1, G*(T-1), S]."""
    B, T = valid.shape
    rows = (valid.sum(dim=1) > 1).nonzero()[:, 0]
    R = rows.shape[0]
    if attention_queries(B, R, T) == B * T:
        return None
    split: dict[str, tuple[Tensor, Tensor]] = {}
    for kind, mask in masks.items():
        if mask is None:  # only the sliding kind, where no window is in play
            continue
        folded = mask.view(B, 1, group, T, mask.shape[-1])
        split[kind] = (folded[:, :, :, 0], folded[rows, :, :, 1:].reshape(R, 1, group * (T - 1), -1))
    if masks.get(SLIDING) is None:
        split[SLIDING] = split[FULL]
    return rows, split
