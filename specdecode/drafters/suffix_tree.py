"""Depth-bounded suffix trees over token sequences, for the `suffix` drafter (SuffixDecoding).

Owns: `SuffixTree` (a suffix trie bounded by ``max_depth``: every substring of length
<= max_depth of the inserted sequences is a path from the root, and each node counts
its occurrences), `speculate` (greedy, frequency-scored expansion of a proposal tree
from a matched node), `best_speculation` (which match length to draft from) and
`GlobalCache` (the outputs of earlier requests in one shared tree, bounded with
roughly least-recently-used eviction).
Does not own: per-request bookkeeping or turning proposals into a `Draft` (suffix.py).

Appending a token ``t`` to a sequence extends every open suffix by ``t``: the sequence
keeps a *state*, the nodes of its last 1..max_depth tokens (depth ascending), and the
new state is ``[root -> t] + [n -> t for n in state[:max_depth - 1]]`` -- max_depth dict
look-ups per token, nothing rebuilt. ``state[k - 1]`` is then also the node of the
sequence's last k tokens, so a sequence matches its own context for free.

Removal replays the same walk with counts decremented, dropping nodes that reach zero,
so evicting a sequence leaves exactly the tree of the others.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


class Node:
    """A trie node: ``count`` occurrences of its path; ``out`` = sum of its children's counts
    (the occurrences that were followed by a token); ``owner`` = the last cache entry through it."""

    __slots__ = ("count", "out", "children", "owner")

    def __init__(self) -> None:
        self.count = 0
        self.out = 0
        self.children: dict[int, Node] = {}
        self.owner = -1


@dataclass
class Speculation:
    """A proposal tree below a matched context: draft nodes numbered from 1 (0 = the root,
    i.e. the newest committed token); ``parents[i]`` is the parent of node i + 1."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # estimated path probability per node
    match_len: int = 0
    node: Node | None = None  # the matched context's node

    @property
    def score(self) -> float:
        """Expected accepted tokens, if the estimates were right: the sum of path probabilities."""
        return sum(self.probs)

    @property
    def is_chain(self) -> bool:
        return all(p == i for i, p in enumerate(self.parents))


class SuffixTree:
    """Suffix trie over any number of sequences, bounded by ``max_depth`` tokens."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()

    def extend(self, state: list[Node], tokens: Sequence[int], delta: int = 1, owner: int = -1) -> list[Node]:
        """Append ``tokens`` to the sequence whose open suffixes are ``state``; returns the new state.

        ``delta = -1`` replays an earlier ``extend`` to remove that sequence's counts.
        """
        root, deep = self.root, self.max_depth - 1
        for t in tokens:
            new: list[Node] = [root]
            new.extend(state[:deep])
            for i, parent in enumerate(new):
                children = parent.children
                child = children.get(t)
                if child is None:
                    child = children[t] = Node()
                child.count += delta
                parent.out += delta
                if delta < 0 and child.count == 0:
                    del children[t]  # its subtree empties as the replay walks on
                elif owner >= 0:
                    child.owner = owner
                new[i] = child
            state = new
        return state

    def find(self, path: Sequence[int]) -> Node | None:
        node: Node | None = self.root
        for t in path:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def match_nodes(self, context: Sequence[int]) -> list[Node]:
        """Nodes of the longest context suffixes that occurred *with a continuation*:
        ``result[k - 1]`` is the node of ``context[-k:]``, for k = 1..L (L may be 0).

        Having a continuation is monotone in k (a suffix followed by x implies every
        shorter suffix followed by x), so L is found by binary search, never a full scan.
        """
        context = context[max(0, len(context) - (self.max_depth - 1)) :]
        n = len(context)
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.find(context[n - mid :])
            if node is not None and node.out > 0:
                lo = mid
            else:
                hi = mid - 1
        return [self.find(context[n - k :]) for k in range(1, lo + 1)]  # type: ignore[misc]

    def as_dict(self, node: Node | None = None) -> dict:
        """{token: (count, subtree)}: the whole tree, for tests."""
        node = node or self.root
        return {t: (c.count, self.as_dict(c)) for t, c in sorted(node.children.items())}


def state_match_nodes(state: list[Node], max_depth: int) -> list[Node]:
    """`SuffixTree.match_nodes` for a sequence's own context, read off its state."""
    lo, hi = 0, min(len(state), max_depth - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if state[mid - 1].out > 0:
            lo = mid
        else:
            hi = mid - 1
    return state[:lo]


def speculate(node: Node, budget: int, min_prob: float) -> Speculation:
    """Grow a proposal tree below ``node`` greedily by estimated path probability.

    A child's probability is ``count / parent.out`` times its parent's; the likeliest
    frontier node is taken next, until ``budget`` nodes are taken or none left scores
    ``>= min_prob``. Nodes come out parents first, siblings likeliest first (ties: first
    seen), and siblings are distinct trie children, as one-hot tree verification needs.
    """
    spec = Speculation(node=node)
    heap: list[tuple[float, int, int, int, Node]] = []  # (-prob, tie, parent index, token, node)
    tie = 0
    frontier = [(1.0, 0, node)]
    while True:
        for prob, index, parent in frontier:
            out = parent.out
            for token, child in parent.children.items():
                p = prob * (child.count / out)  # <= prob exactly: children never outrank parents
                if p >= min_prob:
                    heapq.heappush(heap, (-p, tie, index, token, child))
                    tie += 1
        if not heap or len(spec.tokens) == budget:
            return spec
        neg, _, index, token, child = heapq.heappop(heap)
        spec.tokens.append(token)
        spec.parents.append(index)
        spec.probs.append(-neg)
        frontier = [(-neg, len(spec.tokens), child)]


def spec_budget(match_len: int, cap: int, factor: float) -> int:
    """Arctic's adaptive draft length: at most ``factor`` tokens per matched token, and ``cap``."""
    length = match_len * factor + 1e-6  # inf for a huge factor (any finite one is valid)
    return max(0, cap if length >= cap else int(length))


def best_speculation(matches: list[Node], max_depth: int, cap: int, factor: float, min_prob: float) -> Speculation:
    """The best-scoring proposal among a few match lengths (``matches[k - 1]`` = node of length k).

    A longer match is more specific but leaves ``max_depth - k`` levels below it; a shorter
    one may allow a deeper draft. Arctic scores every k; we score the longest L, the k
    that maximises the room ``min(budget(k), max_depth - k)`` and the midpoint, so a round
    costs at most three expansions. Ties go to the longer match.
    """
    L = len(matches)
    if L == 0:
        return Speculation()
    room = [min(spec_budget(k, cap, factor), max_depth - k) for k in range(L + 1)]
    k_room = max(range(1, L + 1), key=lambda k: (room[k], k))
    best = Speculation()
    for k in sorted({L, (L + k_room) // 2, k_room}, reverse=True):
        spec = speculate(matches[k - 1], spec_budget(k, cap, factor), min_prob)
        spec.match_len = k
        if spec.score > best.score:
            best = spec
    return best


class GlobalCache:
    """Outputs of finished requests in one `SuffixTree`, at most ``max_requests`` of them.

    Entries are evicted roughly least recently used first; an entry is *used* when it is
    added and when a proposal is drawn from a context it was the last to pass through
    (`touch`). Only the last entry through a node is known (one label per node, not a set),
    so where that entry has been evicted since, a proposal from the node refreshes no entry
    and its suppliers age as under first in, first out (vLLM's order). Each entry keeps its
    tokens, so eviction replays them with -1: exact.
    """

    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.max_requests = max_requests
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # LRU first
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, tokens: Sequence[int]) -> int:
        """Cache one finished output; returns its entry id (-1 when caching is disabled)."""
        if self.max_requests == 0 or not tokens:
            return -1
        entry, self._next_id = self._next_id, self._next_id + 1
        self.entries[entry] = tuple(tokens)
        self.tree.extend([], tokens, owner=entry)
        while len(self.entries) > self.max_requests:
            self.remove(next(iter(self.entries)))
        return entry

    def remove(self, entry: int) -> None:
        self.tree.extend([], self.entries.pop(entry), delta=-1)

    def touch(self, entry: int) -> None:
        if entry in self.entries:
            self.entries.move_to_end(entry)
