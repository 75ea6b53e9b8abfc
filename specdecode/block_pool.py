"""The KV cache's block allocator: a free list of block ids shared by every sequence.

Owns: `BlockPool` and `OutOfBlocks`, the error every allocation that cannot be met raises
(allocating nothing). Does not own: block tables or what the blocks hold
(paged_cache.py), or who is preempted when blocks run out (engine/serving.py).
"""

from __future__ import annotations

from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy a request; nothing was allocated. ``needed`` / ``free`` are block counts."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"out of KV cache blocks: need {needed}, {free} free")
        self.needed, self.free = needed, free


class BlockPool:
    """Free-list allocator of ``num_blocks`` block ids ``0 .. num_blocks-1``.

    A stack: `allocate` hands out the lowest free ids of a fresh pool in ascending order,
    and `free` puts blocks back so that the next `allocate` returns them first, in the
    same order. A sequence that gives back its reserved room and reserves again thus gets
    the same blocks, which keeps its table contiguous (see `PagedKVCache`'s slice path).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() from the end
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids; `OutOfBlocks` (allocating nothing) if fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        if n == 0:
            return []
        blocks = self._free[-n:][::-1]
        del self._free[-n:]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Give ``blocks`` back. A block that is free already (or listed twice, or not a block
        id) raises ValueError and frees nothing."""
        blocks = list(blocks)
        for b in blocks:
            if not (isinstance(b, int) and 0 <= b < self.num_blocks):
                raise ValueError(f"not a block id of this pool: {b!r}")
        if len(set(blocks)) != len(blocks) or any(self._is_free[b] for b in blocks):
            raise ValueError(
                f"double free of KV cache blocks {sorted(b for b in blocks if self._is_free[b])} "
                f"(or a block listed twice in {blocks})"
            )
        for b in blocks:
            self._is_free[b] = True
        self._free.extend(reversed(blocks))  # the first of them comes out first

    def grow(self, extra: int) -> None:
        """Add ``extra`` new block ids after the existing ones; they come out after every block
        that is free now (the stack keeps handing out the lowest ids first)."""
        start = self.num_blocks
        self.num_blocks += extra
        self._free[:0] = range(self.num_blocks - 1, start - 1, -1)
        self._is_free.extend([True] * extra)
