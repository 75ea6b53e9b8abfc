"""Paged KV cache: fixed-size blocks from one shared pool, a block table per sequence.

Owns: `PagedKVCache` (a `KVCache` whose rows are named sequences that join and leave
between passes, each holding only the blocks its length needs, from a shared
block_pool.`BlockPool`); `Transformer.new_paged_cache` sizes one for a model.
Does not own: deciding who runs, who waits or who is preempted (the scheduler asks
`blocks_needed` / `pool.num_free` and catches `OutOfBlocks`), or attention (model/).

Life of a sequence::

    cache.add_sequence(sid)                 # empty: no blocks
    cache.set_batch([sid, ...])             # the rows of the next pass, in order
    cache.reserve([T, ...])                 # blocks for slots lengths[b] .. lengths[b]+T-1 (or OutOfBlocks)
    logits = model(tokens, positions, cache)  # writes and reads through the block tables
    cache.commit(num_kept)                  # advance; blocks wholly past the new length go back
    cache.free_sequence(sid)                # finished, cancelled or preempted: every block goes back

The `KVCache` convention holds: a pass writes its T new tokens at slots
``lengths[b] .. lengths[b] + T - 1`` and never advances ``lengths``. So after
``commit`` (or ``truncate``) a sequence holds exactly ``ceil(length / block_size)``
blocks: the room reserved for rejected drafts is released at once, not at the next write.

Storage is ``k, v: [L, num_blocks, block_size, Hkv, D]``. With the block axis outside
the slot axis, gathering a row's blocks is one ``index_select`` of whole blocks, and
``[B, nb, bs, Hkv, D]`` views as ``[B, nb*bs, Hkv, D]`` for free, so attention's
``[B, Hkv, kv_len, D]`` is a transposed view of the gather (one copy per layer). The
``[.., Hkv, block_size, D]`` layout would need a second, permuting copy. The gather plan
(block indices and write indices) is built once per forward pass, on its first
``append``, and reused by every layer. One row whose blocks have consecutive ids (the
usual case: the pool hands out the lowest ids and takes freed ones back first) reads a
plain slice, with no gather at all. Every other pass pays, per layer, one copy of its
rows' K/V (memory-bound, like attention's own read of them): SDPA needs a dense tensor,
and a paged-attention kernel that reads the blocks in place is not ours to add here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdecode.cache.block_pool import BlockPool
from specdecode.cache.kv_cache import KVCache, StorageIndex


@dataclass
class _Seq:
    length: int = 0
    blocks: list[int] = field(default_factory=list)  # its block table: slot s lives in blocks[s // bs]


@dataclass
class _Plan:
    """How one forward pass writes and reads: built on its first `append`, used by every layer."""

    slots: Tensor  # the pass's slots tensor: the key (identity) together with the cache version
    version: int
    kv_len: int
    # one row over consecutive blocks: a slice of the storage (first block, first written slot)
    first_block: int = -1
    write_start: int = 0
    # otherwise: blocks to gather [B * nb] and flat slots to write [B * T]
    read_blocks: Tensor | None = None
    write_index: Tensor | None = None


class PagedKVCache(KVCache):
    """A `KVCache` over a shared `BlockPool`; its rows are the sequences of `set_batch`.

    Sequences are named by hashable ids. The `KVCache` methods act on the current batch:
    ``lengths`` [B] (int64, on ``device``) are its rows' lengths, in `seq_ids` order.
    Treat ``lengths`` as read-only: the cache keeps the same lengths on the host, beside
    the block tables, and replaces the tensor when they change. ``commit``, ``truncate``,
    ``reserve`` and ``select_rows`` read a tensor argument back once (``.tolist()``).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: a ragged batch gathers stale slots past a row's length (masked,
        # but NaN * 0 would still be NaN), and every value ever written is a finite K/V.
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._bind_storage()
        self._seqs: dict[Hashable, _Seq] = {}
        self._batch: list[Hashable] = []
        self._version = 0  # bumped whenever a table or a length of the batch may have changed
        self._plan: _Plan | None = None
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)

    # ---- sequences ---------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable) -> None:
        """A new empty sequence holding no blocks. A duplicate id raises ValueError."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the KV cache")
        self._seqs[seq_id] = _Seq()

    def free_sequence(self, seq_id: Hashable) -> None:
        """Release every block of ``seq_id`` and forget it; it also leaves the current batch
        (so ``lengths`` loses its row). An unknown id is a no-op, so that a cancel racing
        a finish (or a second cancel) is harmless."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self.pool.free(seq.blocks)
        if seq_id in self._batch:
            self._set_rows([s for s in self._batch if s != seq_id])

    def free_all(self) -> None:
        """Release every sequence's blocks (an engine reset after a failed step)."""
        for seq_id in list(self._seqs):
            self.free_sequence(seq_id)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> list[Hashable]:
        """The current batch's ids, in row order."""
        return list(self._batch)

    def seq_length(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].length

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seqs[seq_id].blocks)

    def blocks_needed(self, seq_id: Hashable, num_slots: int) -> int:
        """How many more blocks ``seq_id`` needs to hold ``num_slots`` slots in all (its length
        plus the room wanted); 0 if it holds enough already."""
        return max(0, -(-num_slots // self.block_size) - len(self._seqs[seq_id].blocks))

    def set_batch(self, seq_ids: Sequence[Hashable]) -> None:
        """The rows of the next forward pass, in order (each known, none twice)."""
        seq_ids = list(seq_ids)
        unknown = [s for s in seq_ids if s not in self._seqs]
        if unknown:
            raise KeyError(f"sequences not in the KV cache: {unknown}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in the batch {seq_ids}")
        self._set_rows(seq_ids)

    def reserve(self, room: Sequence[int] | Tensor) -> None:
        """Make row b hold blocks for ``lengths[b] + room[b]`` slots. All or nothing: if the pool
        cannot give every row what it needs, `OutOfBlocks` is raised and nothing is allocated."""
        room = room.tolist() if isinstance(room, Tensor) else list(room)
        if len(room) != len(self._batch):
            raise ValueError(f"reserve needs one room per row: {len(room)} for {len(self._batch)} rows")
        seqs = [self._seqs[s] for s in self._batch]
        need = [self.blocks_needed(s, seq.length + int(r)) for s, seq, r in zip(self._batch, seqs, room)]
        total = sum(need)
        if total == 0:
            return
        blocks = self.pool.allocate(total)  # raises OutOfBlocks before anything changes
        # The last rows first: the pool hands back the latest freed blocks first, and a commit
        # frees the rows' tails in row order, so each row gets back the room it gave up.
        at = 0
        for seq, n in zip(reversed(seqs), reversed(need)):
            seq.blocks.extend(blocks[at : at + n])
            at += n
        self._version += 1

    # ---- KVCache -----------------------------------------------------------------------

    def append(self, layer: int, k: Tensor, v: Tensor, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Write ``k``/``v`` [B, Hkv, T, D] at ``slots`` [B, T] (= ``lengths[b] + t``, the
        `KVCache` convention) through the block tables; return K/V [B, Hkv, kv_len, D]."""
        plan = self._plan
        if plan is None or plan.slots is not slots or plan.version != self._version or plan.kv_len != kv_len:
            plan = self._plan = self._make_plan(slots, kv_len)
        B, Hkv, T, D = k.shape
        if plan.first_block >= 0:  # one row over consecutive blocks: plain slices
            kb, vb = self._k_flat[layer], self._v_flat[layer]
            base = plan.first_block * self.block_size
            kb[base + plan.write_start : base + plan.write_start + T] = k[0].transpose(0, 1)
            vb[base + plan.write_start : base + plan.write_start + T] = v[0].transpose(0, 1)
            ck, cv = kb[base : base + kv_len], vb[base : base + kv_len]  # [kv_len, Hkv, D]
            return ck.transpose(0, 1)[None], cv.transpose(0, 1)[None]
        kf, vf = self._k_flat[layer], self._v_flat[layer]
        kf.index_copy_(0, plan.write_index, k.transpose(1, 2).reshape(B * T, Hkv, D))
        vf.index_copy_(0, plan.write_index, v.transpose(1, 2).reshape(B * T, Hkv, D))
        nb = plan.read_blocks.shape[0] // B
        ck = self._k_blocks[layer].index_select(0, plan.read_blocks).view(B, nb * self.block_size, Hkv, D)
        cv = self._v_blocks[layer].index_select(0, plan.read_blocks).view(B, nb * self.block_size, Hkv, D)
        return ck[:, :kv_len].transpose(1, 2), cv[:, :kv_len].transpose(1, 2)

    def storage_index(self, slots: Tensor, kv_len: int) -> StorageIndex:
        plan = self._plan = self._make_plan(slots, kv_len)
        bs, (_, _, _, Hkv, D) = self.block_size, self.k.shape
        s = torch.arange(kv_len, device=self.device)
        if plan.first_block >= 0:
            index = (plan.first_block * bs + s)[None]
        else:
            index = plan.read_blocks.view(slots.shape[0], -1)[:, s // bs] * bs + s % bs
        return StorageIndex(self._k_flat, self._v_flat, index, Hkv * D, D)

    def commit(self, num_tokens: Tensor | Sequence[int]) -> None:
        """Advance each row by ``num_tokens[b]`` (>= 0, within its reserved blocks), then give back
        every block lying wholly past the new length."""
        counts = num_tokens.tolist() if isinstance(num_tokens, Tensor) else list(num_tokens)
        if len(counts) != len(self._batch):
            raise ValueError(f"commit needs one count per row: {len(counts)} for {len(self._batch)} rows")
        seqs = [self._seqs[s] for s in self._batch]
        for sid, seq, n in zip(self._batch, seqs, counts):
            if n < 0 or seq.length + n > len(seq.blocks) * self.block_size:
                raise ValueError(
                    f"cannot commit {n} slots to sequence {sid!r}: length {seq.length}, "
                    f"{len(seq.blocks)} blocks of {self.block_size} reserved"
                )
        for seq, n in zip(seqs, counts):
            seq.length += int(n)
        self._release_tail(seqs)

    def truncate(self, lengths: Tensor | Sequence[int]) -> None:
        """Roll each row back to ``min(current, lengths[b])``, giving back the blocks past it."""
        target = lengths.tolist() if isinstance(lengths, Tensor) else list(lengths)
        if len(target) != len(self._batch):
            raise ValueError(f"truncate needs one length per row: {len(target)} for {len(self._batch)} rows")
        seqs = [self._seqs[s] for s in self._batch]
        for seq, n in zip(seqs, target):
            seq.length = max(0, min(seq.length, int(n)))
        self._release_tail(seqs)

    def keep_slots(self, row: int, src_slots: Tensor, dst_start: int) -> None:
        """Move the K/V at ``src_slots`` of ``row`` to slots ``dst_start ..`` of the same row (all
        layers). Every slot involved must lie in the row's blocks (one host sync checks it)."""
        seq = self._seqs[self._batch[row]]
        n = int(src_slots.numel())
        if n == 0:
            return
        held = len(seq.blocks) * self.block_size
        lo, hi = torch.stack([src_slots.min(), src_slots.max()]).tolist()
        if lo < 0 or hi >= held or dst_start < 0 or dst_start + n > held:
            raise ValueError(
                f"keep_slots outside row {row}'s {len(seq.blocks)} blocks: slots {lo}..{hi} -> "
                f"{dst_start}..{dst_start + n - 1}, {held} slots held"
            )
        table = torch.tensor(seq.blocks, dtype=torch.long, device=self.device)
        src = src_slots.to(self.device).reshape(-1)
        dst = torch.arange(dst_start, dst_start + n, device=self.device)
        bs = self.block_size
        src_flat = table[src // bs] * bs + src % bs
        dst_flat = table[dst // bs] * bs + dst % bs
        L = self.k.shape[0]
        for buf in (self.k, self.v):
            flat = buf.view(L, -1, *buf.shape[3:])  # [L, num_blocks * bs, Hkv, D]
            flat[:, dst_flat] = flat[:, src_flat]  # the gather copies first, so overlap is safe

    def select_rows(self, rows: Tensor | Sequence[int]) -> None:
        """Keep only ``rows`` of the current batch, in that order; the sequences of the other rows
        are freed (as `ContiguousKVCache` releases them)."""
        rows = rows.tolist() if isinstance(rows, Tensor) else [int(r) for r in rows]
        if len(set(rows)) != len(rows) or any(not 0 <= r < len(self._batch) for r in rows):
            raise ValueError(f"select_rows needs distinct rows in [0, {len(self._batch)}), got {rows}")
        kept = [self._batch[r] for r in rows]
        dropped = set(self._batch) - set(kept)
        for sid in dropped:
            self.pool.free(self._seqs.pop(sid).blocks)
        self._set_rows(kept)

    # ---- internals ---------------------------------------------------------------------

    def _bind_storage(self) -> None:
        """Per-layer views of ``k`` / ``v``: [num_blocks, bs, Hkv, D] and flat [num_blocks * bs, Hkv, D]."""
        L, N, bs, Hkv, D = self.k.shape
        self._k_blocks, self._v_blocks = list(self.k.unbind(0)), list(self.v.unbind(0))
        self._k_flat = [b.view(N * bs, Hkv, D) for b in self._k_blocks]
        self._v_flat = [b.view(N * bs, Hkv, D) for b in self._v_blocks]

    def _set_rows(self, seq_ids: list[Hashable]) -> None:
        self._batch = seq_ids
        self._sync_lengths()

    def max_length(self) -> int:
        return max((self._seqs[s].length for s in self._batch), default=0)  # from the host: no device sync

    def _sync_lengths(self) -> None:
        host = [self._seqs[s].length for s in self._batch]
        self.lengths = torch.tensor(host, dtype=torch.long, device=self.device)
        self._version += 1

    def _release_tail(self, seqs: list[_Seq]) -> None:
        """Free each sequence's blocks wholly past its length; refresh ``lengths``."""
        for seq in seqs:
            keep = -(-seq.length // self.block_size)
            if keep < len(seq.blocks):
                tail = seq.blocks[keep:]
                del seq.blocks[keep:]
                self.pool.free(tail)
        self._sync_lengths()

    def _make_plan(self, slots: Tensor, kv_len: int) -> _Plan:
        """Check that the pass fits the reserved blocks and turn the block tables into indices."""
        bs = self.block_size
        seqs = [self._seqs[s] for s in self._batch]
        B, T = slots.shape
        if B != len(seqs):
            raise ValueError(f"the pass has {B} rows but the KV cache batch has {len(seqs)}")
        for sid, seq in zip(self._batch, seqs):
            if seq.length + T > len(seq.blocks) * bs:
                raise ValueError(
                    f"sequence {sid!r} writes slots {seq.length}..{seq.length + T - 1} but holds "
                    f"{len(seq.blocks)} blocks of {bs}: call reserve() before the forward pass"
                )
        nb = -(-kv_len // bs)
        plan = _Plan(slots=slots, version=self._version, kv_len=kv_len)
        if B == 1:
            blocks = seqs[0].blocks[:nb]
            if len(blocks) == nb and blocks == list(range(blocks[0], blocks[0] + nb)):
                plan.first_block, plan.write_start = blocks[0], seqs[0].length
                return plan
        # rows shorter than kv_len read padding past their blocks: block 0 (finite, and masked)
        rows = [seq.blocks[:nb] + [0] * (nb - len(seq.blocks)) for seq in seqs]
        table = torch.tensor(rows, dtype=torch.long, device=self.device)  # [B, nb]
        plan.read_blocks = table.reshape(-1)
        slots = slots.to(self.device)
        plan.write_index = (table.gather(1, slots // bs) * bs + slots % bs).reshape(-1)
        return plan

