"""The KV cache's block allocator: block ids shared by every sequence, and the prefix cache.

Owns: `BlockPool` (reference counts, the free list, and the cached blocks: full blocks
keyed by their tokens and everything before them, kept after their last holder leaves
and evicted least recently used) and `OutOfBlocks`, the error every allocation that
cannot be met raises (allocating nothing). Does not own: block tables, what the blocks
hold, or which tokens a block's key names (paged_cache.py), or who is preempted when
blocks run out (engine/serving.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy a request; nothing was allocated. ``needed`` / ``free`` are block counts."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"out of KV cache blocks: need {needed}, {free} free")
        self.needed, self.free = needed, free


class BlockPool:
    """Reference-counted allocator of ``num_blocks`` block ids ``0 .. num_blocks-1``.

    Free blocks are a stack: `allocate` hands out the lowest free ids of a fresh pool in
    ascending order, and `free` puts blocks back so that the next `allocate` returns them
    first, in the same order. A sequence that gives back its reserved room and reserves
    again thus gets the same blocks, which keeps its table contiguous (see `PagedKVCache`'s
    slice path).

    The prefix cache: `register` names a full block by a key; `lookup` finds it, and
    `share` adds a holder. A registered block whose last holder frees it is not reused
    at once: it waits, evictable, until `allocate` runs out of free blocks and takes the
    least recently released one (its key is forgotten then). ``num_free`` counts both.
    Keys are exact (a dict, no hash collisions can alias two prefixes); each registered
    block also gets a fresh integer ``uid`` that its children's keys name.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() from the end
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by no one; oldest first
        self._by_key: dict[Hashable, int] = {}
        self._key: dict[int, Hashable] = {}  # block -> its key, for registered blocks
        self._uid: dict[int, int] = {}
        self._extra: dict[int, Any] = {}  # what a caller keeps beside a registered block (a drafter's features)
        self._next_uid = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones no one holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._key)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh block ids (each held once); `OutOfBlocks` (allocating nothing) if fewer
        than ``n`` are free. Cached blocks no one holds are evicted, oldest first, when the
        free ones run out."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        while len(self._free) < n:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self._free.append(block)
        if n == 0:
            return []
        blocks = self._free[-n:][::-1]
        del self._free[-n:]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one hold of each of ``blocks``. A block held by no one (or listed twice, or not
        a block id) raises ValueError and frees nothing. A block whose last hold goes is free
        again, or, if registered, evictable: released in list order, the last listed evicted
        first (a sequence's tail goes before the prefix others may share)."""
        blocks = list(blocks)
        for b in blocks:
            if not (isinstance(b, int) and 0 <= b < self.num_blocks):
                raise ValueError(f"not a block id of this pool: {b!r}")
        if len(set(blocks)) != len(blocks) or any(self._refs[b] == 0 for b in blocks):
            raise ValueError(
                f"double free of KV cache blocks {sorted(b for b in blocks if self._refs[b] == 0)} "
                f"(or a block listed twice in {blocks})"
            )
        released = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                released.append(b)
        for b in reversed(released):
            if b in self._key:
                self._evictable[b] = None
        self._free.extend(b for b in reversed(released) if b not in self._key)  # the first of them comes out first

    def grow(self, extra: int) -> None:
        """Add ``extra`` new block ids after the existing ones; they come out after every block
        that is free now (the stack keeps handing out the lowest ids first)."""
        start = self.num_blocks
        self.num_blocks += extra
        self._free[:0] = range(self.num_blocks - 1, start - 1, -1)
        self._refs.extend([0] * extra)

    # ---- the prefix cache --------------------------------------------------------------

    def lookup(self, key: Hashable) -> tuple[int, int] | None:
        """(block, uid) registered under ``key``, or None."""
        block = self._by_key.get(key)
        return None if block is None else (block, self._uid[block])

    def share(self, block: int) -> None:
        """One more holder of a registered ``block`` (an evictable one is held again)."""
        if block not in self._key:
            raise ValueError(f"block {block} is not cached: only cached blocks are shared")
        self._evictable.pop(block, None)
        self._refs[block] += 1

    def register(self, block: int, key: Hashable, extra: Any = None) -> int:
        """Name a held, full ``block`` by ``key``; returns the uid that names it in its children's
        keys. If another block has the key already, ``block`` stays unnamed and that block's uid
        is returned (its ``extra`` filled in if it had none)."""
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is free: only held blocks are registered")
        if key in self._by_key:
            other = self._by_key[key]
            if self._extra.get(other) is None and extra is not None:
                self._extra[other] = extra
            return self._uid[other]
        if block in self._key:
            raise ValueError(f"block {block} is registered already")
        self._by_key[key], self._key[block] = block, key
        self._uid[block], self._next_uid = self._next_uid, self._next_uid + 1
        if extra is not None:
            self._extra[block] = extra
        return self._uid[block]

    def unregister(self, block: int) -> None:
        """Forget a held block's key (its holder is about to change what it holds)."""
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is free")
        self._forget(block)

    def is_registered(self, block: int) -> bool:
        return block in self._key

    def extra(self, block: int) -> Any:
        return self._extra.get(block)

    def _forget(self, block: int) -> None:
        key = self._key.pop(block, None)
        if key is not None:
            del self._by_key[key]
            del self._uid[block]
            self._extra.pop(block, None)
