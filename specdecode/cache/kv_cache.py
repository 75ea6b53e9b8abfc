"""KV cache: where each layer's keys and values live between forward passes.

Owns: the storage, the per-row valid length, and the operations the engine needs
(append new positions, commit accepted ones, roll back rejected ones, drop rows).
Does not own: deciding what is accepted (verify.py) or attention itself (model/).

Convention (gpt-fast style): a forward pass *writes* the K/V of its T new tokens at
slots ``lengths[b] .. lengths[b] + T - 1`` of each row but does not advance
``lengths``. The engine then calls :meth:`commit` with how many of those slots are
kept. Rejected drafts therefore cost nothing to roll back: their slots lie past the
row's length and are overwritten by the next write. ``lengths`` never moves as a
side effect of attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StorageIndex:
    """Where a pass's K/V live, for kernels that read and write the cache in place: the K/V
    of kv head h at (row b, slot s) of layer l start at element
    ``index[b, s] * slot_stride + h * head_stride`` of ``keys[l]`` / ``values[l]``."""

    keys: list[torch.Tensor]  # per layer, contiguous storage
    values: list[torch.Tensor]
    index: torch.Tensor  # [B, kv_len] int64
    slot_stride: int
    head_stride: int


class KVCache(ABC):
    """Interface that the transformer reads and writes through.

    ``lengths`` [B] (int64) is the number of valid slots per row. A paged
    implementation replaces this class without touching the model.
    """

    lengths: torch.Tensor  # [B]

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def max_length(self) -> int:
        """The longest row's length (0 without rows): a host sync here, none where the cache
        keeps its lengths on the host too (the paged cache)."""
        return int(self.lengths.max()) if self.batch_size else 0

    @abstractmethod
    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` [B, Hkv, T, D] at ``slots`` [B, T] of ``layer``.

        Returns keys and values [B, Hkv, kv_len, D] covering slots ``0 .. kv_len-1``
        (the caller masks what each query may see).
        """

    @abstractmethod
    def commit(self, num_tokens: torch.Tensor) -> None:
        """Advance each row's length by ``num_tokens`` [B] (>= 0)."""

    @abstractmethod
    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll each row back to ``min(current, lengths[b])``."""

    @abstractmethod
    def keep_slots(self, row: int, src_slots: torch.Tensor, dst_start: int) -> None:
        """Move the K/V at ``src_slots`` of ``row`` to contiguous slots from ``dst_start``.

        Used to compact an accepted tree path into contiguous positions.
        """

    @abstractmethod
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (in that order) and release the storage of the others."""

    def storage_index(self, slots: torch.Tensor, kv_len: int) -> StorageIndex | None:
        """The pass's storage, after the same checks as `append`; None = this cache has none."""
        return None


class ContiguousKVCache(KVCache):
    """Dense ``[L, B, Hkv, capacity, D]`` buffers: one fixed slab per row."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if capacity < 1 or batch_size < 1:
            raise ValueError(f"cache needs capacity >= 1 and batch >= 1, got {capacity}, {batch_size}")
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_len > self.capacity:
            raise ValueError(f"KV cache overflow: need {kv_len} slots, capacity is {self.capacity}")
        ck, cv = self.k[layer], self.v[layer]  # [B, Hkv, S, D]
        B, _, T, _ = k.shape
        if B == 1:
            # Hot path for a single sequence: contiguous slice assignment, no index_put, and
            # no host sync: with one row, kv_len = lengths[0] + T.
            start = kv_len - T
            ck[:, :, start : start + T] = k
            cv[:, :, start : start + T] = v
        else:
            rows = torch.arange(B, device=k.device)[:, None]  # [B, 1]
            # Advanced indices on dims 0 and 2 put the indexed dims first: [B, T, Hkv, D].
            ck[rows, :, slots] = k.transpose(1, 2)
            cv[rows, :, slots] = v.transpose(1, 2)
        return ck[:, :, :kv_len], cv[:, :, :kv_len]

    def storage_index(self, slots: torch.Tensor, kv_len: int) -> StorageIndex:
        if kv_len > self.capacity:
            raise ValueError(f"KV cache overflow: need {kv_len} slots, capacity is {self.capacity}")
        L, B, Hkv, S, D = self.k.shape
        index = torch.arange(B, device=self.k.device)[:, None] * Hkv * S + torch.arange(kv_len, device=self.k.device)
        return StorageIndex(list(self.k.unbind(0)), list(self.v.unbind(0)), index, D, S * D)

    def commit(self, num_tokens: torch.Tensor) -> None:
        self.lengths += num_tokens.to(self.lengths)

    def truncate(self, lengths: torch.Tensor) -> None:
        self.lengths = torch.minimum(self.lengths, lengths.to(self.lengths))

    def keep_slots(self, row: int, src_slots: torch.Tensor, dst_start: int) -> None:
        n = int(src_slots.numel())
        dst = slice(dst_start, dst_start + n)
        for buf in (self.k, self.v):
            r = buf[:, row]  # [L, Hkv, S, D] view
            r[:, :, dst] = r[:, :, src_slots]  # the gather copies first, so overlap is safe

    def concat_rows(self, other: "ContiguousKVCache") -> "ContiguousKVCache":
        """This cache's rows followed by ``other``'s (same layers, heads and capacity): rows that joined."""
        if other.k.shape[0] != self.k.shape[0] or other.k.shape[2:] != self.k.shape[2:]:
            raise ValueError(f"cannot join caches of shapes {list(self.k.shape)} and {list(other.k.shape)}")
        self.k = torch.cat([self.k, other.k], dim=1)
        self.v = torch.cat([self.v, other.v], dim=1)
        self.lengths = torch.cat([self.lengths, other.lengths])
        return self

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.lengths.device)
        self.k = self.k[:, rows].contiguous()
        self.v = self.v[:, rows].contiguous()
        self.lengths = self.lengths[rows].clone()


class NoCache(KVCache):
    """No history and nothing kept: one forward over whole sequences, differentiable
    (training a drafter). Writing into a shared buffer would break autograd, so `append`
    hands the new K/V straight back."""

    def __init__(self, batch_size: int, device: torch.device | str) -> None:
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def commit(self, num_tokens: torch.Tensor) -> None:
        raise RuntimeError("NoCache keeps nothing; use a ContiguousKVCache to decode")

    def truncate(self, lengths: torch.Tensor) -> None:
        raise RuntimeError("NoCache keeps nothing")

    def keep_slots(self, row: int, src_slots: torch.Tensor, dst_start: int) -> None:
        raise RuntimeError("NoCache keeps nothing")

    def select_rows(self, rows: torch.Tensor) -> None:
        self.lengths = self.lengths[rows.to(self.lengths.device)]
