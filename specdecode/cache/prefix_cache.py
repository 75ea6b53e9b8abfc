"""Automatic prefix caching: a paged KV cache whose full blocks outlive their sequence.

Owns: `PrefixCachingKVCache`, a `PagedKVCache` that names each committed full block by
its tokens and the blocks before it (`publish`), lets a new sequence start from the
longest cached run of its prompt's blocks (`match_prefix`), and copies a shared block
before anyone writes into it. Counts ``queries`` and ``hits`` in tokens, as vLLM's
``prefix_cache_queries`` / ``prefix_cache_hits``. Does not own: the reference counts and
eviction (block_pool.py), or when to match and publish (engine/serving.py).

Block i of a sequence is keyed by ``(uid of block i-1, its bs tokens)``: exact, so two
prefixes never alias, and a block's key implies everything before it. A block is
published only once it is full and committed, so rollback never reaches a cached block
by writing: it can only truncate into one, and the next write then copies it
(refcount > 1) or takes it out of the cache (held by this sequence alone).

    cache.add_sequence(sid)
    hit = cache.match_prefix(sid, prompt, len(prompt) - 1)  # length = hit: those slots are cached
    ... reserve / forward / commit as for any PagedKVCache ...
    cache.publish(sid, token_ids)                           # the full committed blocks are cached
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from specdecode.cache.block_pool import OutOfBlocks
from specdecode.cache.paged_cache import PagedKVCache, _Plan


class PrefixCachingKVCache(PagedKVCache):
    """A `PagedKVCache` that shares full blocks between sequences (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keys: dict[Hashable, list[int]] = {}  # uids of each sequence's leading cached blocks
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, found cached

    def match_prefix(
        self, seq_id: Hashable, tokens: Sequence[int], max_tokens: int, usable: Callable[[Any], bool] | None = None
    ) -> int:
        """Start the empty ``seq_id`` from the longest run of cached full blocks of ``tokens``
        covering at most ``max_tokens`` tokens (``usable(extra)`` may refuse a block by what
        was kept beside it). Returns the tokens matched: the sequence's new length."""
        seq = self._seqs[seq_id]
        if seq.blocks or seq.length:
            raise ValueError(f"sequence {seq_id!r} holds blocks already: only an empty one matches a prefix")
        bs, parent, blocks, uids = self.block_size, None, [], []
        for i in range(max(0, max_tokens) // bs):
            found = self.pool.lookup((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if found is None or (usable is not None and not usable(self.pool.extra(found[0]))):
                break
            blocks.append(found[0])
            parent = found[1]
            uids.append(parent)
        for b in blocks:
            self.pool.share(b)
        seq.blocks, seq.length, self._keys[seq_id] = blocks, len(blocks) * bs, uids
        self.queries += len(tokens)
        self.hits += seq.length
        self._sync_lengths()
        return seq.length

    def publish(self, seq_id: Hashable, tokens: Sequence[int], extra: Callable[[int], Any] | None = None) -> None:
        """Cache every full block of ``seq_id`` that its committed length covers; ``tokens`` are
        the sequence's tokens (slot s holds token s). ``extra(i)``, where given, is kept beside
        block i (while it stays cached)."""
        seq, keys = self._seqs[seq_id], self._keys[seq_id]
        bs = self.block_size
        parent = keys[-1] if keys else None
        for i in range(len(keys), min(seq.length, len(tokens)) // bs):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            parent = self.pool.register(seq.blocks[i], key, extra(i) if extra is not None else None)
            keys.append(parent)

    # ---- PagedKVCache, with sharing ----------------------------------------------------

    def add_sequence(self, seq_id: Hashable) -> None:
        super().add_sequence(seq_id)
        self._keys[seq_id] = []

    def free_sequence(self, seq_id: Hashable) -> None:
        super().free_sequence(seq_id)
        self._keys.pop(seq_id, None)

    def select_rows(self, rows: Tensor | Sequence[int]) -> None:
        before = self.seq_ids
        super().select_rows(rows)
        for sid in set(before) - set(self.seq_ids):
            self._keys.pop(sid, None)

    def truncate(self, lengths: Tensor | Sequence[int]) -> None:
        super().truncate(lengths)
        for sid in self._batch:
            seq, keys = self._seqs[sid], self._keys[sid]
            del keys[seq.length // self.block_size :]
            tail = self._written_block(seq)
            if tail is not None and self.pool.refs(tail) == 1 and self.pool.is_registered(tail):
                self.pool.unregister(tail)  # ours alone: the next write changes it

    def reserve(self, room: Sequence[int] | Tensor) -> None:
        """As `PagedKVCache.reserve`; a row whose next write lands in a shared block gets its own
        copy first (counted in what must be free, so that `OutOfBlocks` still changes nothing)."""
        room = room.tolist() if isinstance(room, Tensor) else list(room)
        seqs = [self._seqs[s] for s in self._batch]
        shared = [i for i, seq in enumerate(seqs) if self._shared_tail(seq)]
        if shared:
            need = sum(self.blocks_needed(s, seq.length + int(r)) for s, seq, r in zip(self._batch, seqs, room))
            if need + len(shared) > self.pool.num_free:
                raise OutOfBlocks(need + len(shared), self.pool.num_free)
            for i in shared:
                self._copy_tail(seqs[i])
        super().reserve(room)

    def _make_plan(self, slots: Tensor, kv_len: int) -> _Plan:
        for sid in self._batch:
            if self._shared_tail(self._seqs[sid]):
                raise ValueError(f"sequence {sid!r} would write into a shared block: call reserve() first")
        return super()._make_plan(slots, kv_len)

    # ---- internals ---------------------------------------------------------------------

    def _written_block(self, seq: Any) -> int | None:
        """The held block the sequence's next slot lands in, if it is partly filled already."""
        i = seq.length // self.block_size
        return seq.blocks[i] if seq.length % self.block_size and i < len(seq.blocks) else None

    def _shared_tail(self, seq: Any) -> bool:
        b = self._written_block(seq)
        return b is not None and (self.pool.refs(b) > 1 or self.pool.is_registered(b))

    def _copy_tail(self, seq: Any) -> None:
        """Copy on write: the partly filled block the sequence writes next becomes its own."""
        i = seq.length // self.block_size
        old = seq.blocks[i]
        if self.pool.refs(old) == 1:
            self.pool.unregister(old)
            return
        (new,) = self.pool.allocate(1)
        with torch.no_grad():
            self.k[:, new] = self.k[:, old]
            self.v[:, new] = self.v[:, old]
        self.pool.free([old])
        seq.blocks[i] = new
        self._version += 1
