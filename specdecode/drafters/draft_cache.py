"""A drafter's own KV cache: paged blocks from a pool that grows, one sequence per batch row.

Owns: `DraftKVCache`, the cache of a drafter's network (a draft model, EAGLE's layer,
DFlash's body). It is a `PagedKVCache`, so rejected drafts' slots and finished rows give
their blocks back at once (``commit`` / ``truncate`` free the blocks past a row's length,
``select_rows`` frees dropped rows), and a joining row costs only its own blocks: no
copy of the other rows' K/V, as concatenating contiguous caches would.

Two things differ from the target's cache, because the drafter, not the scheduler, drives it:

- *Rows are anonymous.* ``join_rows(n)`` appends n empty rows at the end of the batch,
  as the `Drafter` protocol appends joining requests; ``select_rows`` keeps rows in order.
- *Every pass reserves what it writes.* A drafter writes its pending tokens, chain steps or
  tree blocks past a row's length without a scheduler to reserve them first; the first
  layer's ``append`` of a pass reserves each row's written slots, and when the pool is
  short it doubles (the K/V are copied once into the larger storage). Its size therefore
  follows the peak of what the rows hold. That peak is bounded by the target's pool: a
  drafter never holds more than the target's committed tokens plus one round's room
  per row, and the scheduler preempts on the target's pool (engine/serving.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from specdecode.cache.block_pool import OutOfBlocks
from specdecode.model.transformer import Transformer
from specdecode.cache.paged_cache import PagedKVCache, _Plan

BLOCK_SIZE = 16
INITIAL_BLOCKS = 32


class DraftKVCache(PagedKVCache):
    """A growing `PagedKVCache` whose rows a drafter appends and selects (see the module docstring)."""

    def __init__(self, model: Transformer, num_blocks: int = INITIAL_BLOCKS, block_size: int = BLOCK_SIZE) -> None:
        c, w = model.config, model.embed.weight
        super().__init__(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, w.dtype, w.device)
        self._ids = itertools.count()

    def join_rows(self, n: int) -> list[int]:
        """Append ``n`` empty rows at the end of the batch; returns their sequence ids."""
        ids = [next(self._ids) for _ in range(n)]
        for sid in ids:
            self.add_sequence(sid)
        self.set_batch(self.seq_ids + ids)
        return ids

    @contextmanager
    def only(self, seq_ids: list[int]) -> Iterator[None]:
        """Passes inside run on ``seq_ids`` alone (a joining row's prefill); the batch comes back after."""
        everyone = self.seq_ids
        self.set_batch(seq_ids)
        try:
            yield
        finally:
            self.set_batch(everyone)

    def grow(self, extra: int) -> None:
        """``extra`` more blocks: new zeroed storage holding the old K/V, the pool extended."""
        L, N, bs, Hkv, D = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros((L, N + extra, bs, Hkv, D), dtype=old.dtype, device=old.device)
            new[:, :N] = old
            setattr(self, name, new)
        self._bind_storage()
        self.pool.grow(extra)
        self._version += 1

    def _make_plan(self, slots: Tensor, kv_len: int) -> _Plan:
        T = slots.shape[1]
        try:
            self.reserve([T] * len(self.seq_ids))
        except OutOfBlocks as short:
            self.grow(max(self.pool.num_blocks, short.needed - short.free))
            self.reserve([T] * len(self.seq_ids))
        return super()._make_plan(slots, kv_len)
