"""Draft trees: the shape a tree proposal takes, and the tensors the target pass needs.

Owns: `DraftTree` (one row's tree, built from a chain, from Medusa / vLLM
``speculative_token_tree`` choices, or from EAGLE-2 parent pointers), `parse_token_tree`
(choices -> parent pointers, depth and child rank, validated), `TreeBatch` (trees of
different sizes padded into [B, N] tensors: tokens, parents, mask, depth, children) and
the cache compaction after verification (`kept_slots`, `commit_paths`).
Does not own: accepting nodes (verify.py), proposing trees (drafters/), or running the
target (engine/).

Node 0 is the *root*: the newest committed token, not yet in the target's cache, fed
together with the drafts exactly as the chain engine feeds ``[last, d_1..d_γ]``. Nodes
1..N-1 are draft tokens in topological order (``parents[i] < i``). Siblings are tried by
the verifier in node order, so a drafter puts its likeliest child first. Node i sees node
j iff j is i or one of its ancestors; the mask is built the EAGLE way (row i = row of its
parent OR itself) and a node's depth is its row sum minus 1. The target runs the tree as::

    logits = model(trees.tokens.clamp(min=0), trees.positions(cache.lengths), cache, block_mask=trees.mask)

and ``logits[b, n]`` is its distribution for the token *following* node n. The spec's
five-node example ``[r, a, b, c, d]`` (a, b children of r; c, d children of a) is
``DraftTree.from_parents(tokens, [-1, 0, 0, 1, 1])`` or
``DraftTree.from_paths(r, [(0,), (1,), (0, 0), (0, 1)], [a, b, c, d])``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from torch import Tensor

from specdecode.config import SpecDecodeError, is_int

if TYPE_CHECKING:
    from specdecode.cache.kv_cache import KVCache

Choice = tuple[int, ...]
MAX_TREE_NODES = 256  # the most draft nodes a drafter may propose in one round


def check_node_budget(budget: object) -> None:
    """A drafter's ``num_draft_tokens`` option: None (its default) or an int in [1, MAX_TREE_NODES]."""
    if budget is None:
        return
    if not is_int(budget) or not 1 <= budget <= MAX_TREE_NODES:
        raise SpecDecodeError(
            f"num_draft_tokens (the tree node budget) must be in [1, {MAX_TREE_NODES}], got {budget!r}"
        )


@dataclass(frozen=True)
class TreeShape:
    """A static tree without tokens, from `parse_token_tree`. Index 0 is the root.

    ``choices[i]`` is node i's child-rank path from the root (``()`` for the root);
    ``parents[i]`` its parent (-1 for the root); ``depth[i]`` = ``len(choices[i])``;
    ``rank[i]`` = ``choices[i][-1]``, its rank among its siblings (-1 for the root). A
    drafter fills node i with the ``rank[i]``-th most likely token after its parent.
    """

    choices: tuple[Choice, ...]
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)


def parse_token_tree(
    choices: str | Sequence[Sequence[int]], vocab: int | None = None, gamma: int | None = None
) -> TreeShape:
    """Validate a ``speculative_token_tree`` and turn it into parent pointers.

    ``choices`` lists the draft nodes as child-rank paths from the root, as Medusa and
    vLLM write it: ``[(0,), (0, 0), (1,), (0, 1)]`` is the root's top-2 children, and the
    top-2 children of its first child. A string is parsed as a Python literal (vLLM's
    form). Entries are tuples or lists of ints >= 0; the list must be non-empty, without
    duplicates, and prefix-closed (every proper prefix of an entry is an entry too). Rank
    gaps are allowed: ``[(0,), (2,)]`` drafts the first and third choice.

    Nodes are numbered breadth-first with siblings by rank (Medusa's ``sorted(key=(len,
    path))``), whatever the input order: node i (i >= 1) is the (i-1)-th sorted choice.
    Raises `SpecDecodeError` with a one-line message on malformed input, on a rank the
    draft's ``vocab`` (where given) has no token for, or on nodes deeper than ``gamma`` (where
    given): a round verifies at most γ tokens along a path, so they would be drafted for nothing.
    """
    if isinstance(choices, str):
        try:
            choices = ast.literal_eval(choices)
        except (ValueError, SyntaxError):
            raise SpecDecodeError(f"speculative_token_tree is not a list of tuples: {choices!r}") from None
    if not isinstance(choices, (list, tuple)):
        raise SpecDecodeError(f"speculative_token_tree must be a list of tuples, got {type(choices).__name__}")
    if len(choices) == 0:
        raise SpecDecodeError("speculative_token_tree must list at least one draft node, e.g. [(0,)]")
    paths: list[Choice] = []
    for entry in choices:
        ok = isinstance(entry, (list, tuple)) and all(
            is_int(r) and r >= 0 for r in entry
        )
        if not ok:
            raise SpecDecodeError(
                f"speculative_token_tree entries must be tuples of ints >= 0 like (0, 1), got {entry!r}"
                + (" (write (0,) for a one-element tuple)" if isinstance(entry, int) else "")
            )
        if len(entry) == 0:
            raise SpecDecodeError("speculative_token_tree entry () is the root, which is implicit; list draft nodes only")
        paths.append(tuple(entry))
    seen: set[Choice] = set()
    for path in paths:
        if path in seen:
            raise SpecDecodeError(f"speculative_token_tree lists {path} twice")
        seen.add(path)
    for path in paths:
        for k in range(1, len(path)):
            if path[:k] not in seen:
                raise SpecDecodeError(f"speculative_token_tree has {path} but not its prefix {path[:k]}")
    if vocab is not None and max(max(p) for p in paths) >= vocab:
        raise SpecDecodeError(
            f"speculative_token_tree asks for rank {max(max(p) for p in paths)}, the vocabulary has {vocab}"
        )
    if gamma is not None and max(len(p) for p in paths) > gamma:
        raise SpecDecodeError(
            f"speculative_token_tree is {max(len(p) for p in paths)} deep but num_speculative_tokens is {gamma}: "
            "set it to the tree's depth"
        )
    ordered: list[Choice] = [(), *sorted(paths, key=lambda c: (len(c), c))]
    index = {c: i for i, c in enumerate(ordered)}
    return TreeShape(
        choices=tuple(ordered),
        parents=tuple(-1 if not c else index[c[:-1]] for c in ordered),
        depth=tuple(len(c) for c in ordered),
        rank=tuple(c[-1] if c else -1 for c in ordered),
    )


@dataclass(frozen=True)
class DraftTree:
    """One row's draft tree. Build it with `from_chain`, `from_paths` or `from_parents`.

    tokens [N] int64 (node 0 = root); parents [N] int64 (parents[0] = -1, parents[i] < i);
    mask [N, N] bool (mask[i, j]: node i sees node j); depth [N] int64 (root 0: node i's
    position id is ``cache_len + depth[i]``); children[i]: node i's children in node order
    (= the order the verifier tries them); paths: root-to-leaf node-index lists, one per
    leaf, in leaf order. Tensors live on the device of ``tokens``.
    """

    tokens: Tensor
    parents: Tensor
    mask: Tensor
    depth: Tensor
    children: tuple[tuple[int, ...], ...]
    paths: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def choices(self) -> tuple[Choice, ...]:
        """Each node's child-rank path from the root (root: ``()``): the `from_paths` form."""
        out: list[Choice] = [()]
        for i, parent in enumerate(self.parents.tolist()[1:], start=1):
            out.append(out[parent] + (self.children[parent].index(i),))
        return tuple(out)

    @staticmethod
    def from_chain(root_token: int, tokens: Sequence[int] | Tensor) -> "DraftTree":
        """The one-branch tree ``root -> tokens[0] -> tokens[1] -> ...``; its mask is causal."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        all_tokens = torch.cat([tokens.new_tensor([int(root_token)]), tokens])
        return DraftTree.from_parents(all_tokens, list(range(-1, tokens.shape[0])))

    @staticmethod
    def from_paths(
        root_token: int, choices: str | Sequence[Sequence[int]], tokens: Sequence[int] | Tensor
    ) -> "DraftTree":
        """A static tree: ``tokens[k]`` is the draft token at ``choices[k]`` (see `parse_token_tree`).

        Nodes are renumbered breadth-first with siblings by rank, so the tree is the same
        whatever order ``choices`` lists them in.
        """
        shape = parse_token_tree(choices)
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if tokens.shape[0] != shape.num_nodes - 1:
            raise SpecDecodeError(
                f"speculative_token_tree has {shape.num_nodes - 1} nodes but {tokens.shape[0]} tokens were given"
            )
        if isinstance(choices, str):
            choices = ast.literal_eval(choices)
        where = {tuple(c): k for k, c in enumerate(choices)}
        order = torch.tensor([where[c] for c in shape.choices[1:]], dtype=torch.long, device=tokens.device)
        all_tokens = torch.cat([tokens.new_tensor([int(root_token)]), tokens[order]])
        return DraftTree.from_parents(all_tokens, shape.parents)

    @staticmethod
    def from_parents(tokens: Sequence[int] | Tensor, parents: Sequence[int] | Tensor) -> "DraftTree":
        """A tree from parent pointers (EAGLE-2): ``parents[0] = -1`` and ``0 <= parents[i] < i``."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parent_list = [int(x) for x in (parents.tolist() if isinstance(parents, Tensor) else parents)]
        N = len(parent_list)
        if N == 0 or tokens.shape[0] != N:
            raise ValueError(f"a tree needs a root and one parent per token: {tokens.shape[0]} tokens, {N} parents")
        if parent_list[0] != -1 or any(not 0 <= q < i for i, q in enumerate(parent_list) if i > 0):
            raise ValueError(f"parents must be -1 for the root and in [0, i) for node i, got {parent_list}")
        if bool((tokens < 0).any()):
            raise ValueError(f"tree tokens must be >= 0, got {tokens.tolist()}")
        mask = torch.eye(N, dtype=torch.bool, device=tokens.device)
        for i in range(1, N):
            mask[i] |= mask[parent_list[i]]  # row i = row of its parent OR itself
        children: list[list[int]] = [[] for _ in range(N)]
        for i in range(1, N):
            children[parent_list[i]].append(i)
        paths: list[tuple[int, ...]] = []
        for leaf in (i for i in range(N) if not children[i]):
            path = [leaf]
            while path[-1] != 0:
                path.append(parent_list[path[-1]])
            paths.append(tuple(reversed(path)))
        return DraftTree(
            tokens=tokens,
            parents=torch.tensor(parent_list, dtype=torch.long, device=tokens.device),
            mask=mask,
            depth=mask.sum(dim=1) - 1,
            children=tuple(tuple(c) for c in children),
            paths=tuple(paths),
        )


@dataclass(frozen=True)
class TreeBatch:
    """B trees padded to N nodes: what the target pass and the tree verifier take.

    tokens [B, N] int64, -1 on padding; parents [B, N] int64, -1 for roots and padding;
    mask [B, N, N] bool (a padded node sees only itself and no real node sees it); depth
    [B, N] int64 (0 on padding); valid [B, N] bool; children [B, N, C] int64: node n's
    children in node order, -1 padded. Host-side: ``max_depth`` D (the deepest real node;
    the verifier returns [B, D+1]) and ``fanout[d]``, the most children any depth-d node
    has (d < D), so the verifier loops over exactly the sibling slots that exist.
    Build with `batch_trees`, `TreeBatch.from_parents` or `TreeBatch.from_chains`.
    """

    tokens: Tensor
    parents: Tensor
    mask: Tensor
    depth: Tensor
    valid: Tensor
    children: Tensor
    max_depth: int
    fanout: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def positions(self, cache_lengths: Tensor) -> Tensor:
        """[B, N] position ids: ``cache_lengths[b] + depth[b, n]`` (padding sits at the root's)."""
        return cache_lengths[:, None] + self.depth

    @staticmethod
    def from_parents(tokens: Tensor, parents: Tensor) -> "TreeBatch":
        """The batch from parent pointers, e.g. an EAGLE-2 tree or a static tree's top-k.

        tokens, parents [B, N] int64. Node 0 of each row is its root (parent -1, token >= 0).
        A node n >= 1 is real iff ``parents[b, n] >= 0``; it must then have a real parent
        ``< n`` and a token >= 0. Padding nodes have parent -1 (their token is ignored and
        reported as -1). Built in numpy on the host (one copy there and back on an accelerator):
        ~30 array ops on a few dozen nodes, where the same in torch ops would each pay a dispatch,
        every round.
        """
        if tokens.dim() != 2 or parents.shape != tokens.shape or tokens.shape[1] == 0:
            raise ValueError(f"tokens and parents must both be [B, N>=1], got {list(tokens.shape)}, {list(parents.shape)}")
        device = tokens.device
        tok, par = (t.detach().cpu().numpy().astype(np.int64) for t in (tokens, parents))
        B, N = tok.shape
        rows, node = np.arange(B)[:, None], np.arange(N)
        valid = par >= 0
        valid[:, 0] = True
        parent_at = np.maximum(par, 0)  # [B, N] safe to index with
        real_child = valid.copy()
        real_child[:, 0] = False
        bad = real_child & ((par >= node) | ~valid[rows, parent_at])
        bad |= valid & (tok < 0)
        if bad.any() or (par[:, 0] != -1).any():
            raise ValueError("malformed tree batch: each real node needs a token >= 0 and a real parent before it")

        mask = np.repeat(np.eye(N, dtype=bool)[None], B, axis=0)  # [B, N, N]
        for i in range(1, N):  # row i = row of its parent OR itself, for every tree at once
            mask[:, i] |= mask[rows[:, 0], parent_at[:, i]] & real_child[:, i, None]
        depth = mask.sum(axis=2) - 1  # [B, N]

        # Sibling rank = how many earlier real nodes share the parent; children[b, parent, rank] = node.
        same_parent = (par[:, :, None] == par[:, None, :]) & real_child[:, :, None] & real_child[:, None, :]
        rank = (same_parent & (node[None, :] < node[:, None])[None]).sum(axis=2)  # [B, N]
        num_children = np.zeros((B, N), dtype=np.int64)
        np.add.at(num_children, (rows, parent_at), real_child)
        max_depth, width = int(depth.max()), max(int(num_children.max()), 1)
        # most children per depth over the batch (padding has none)
        fanout = np.zeros(N, dtype=np.int64)
        np.maximum.at(fanout, depth[valid], num_children[valid])
        # children[b, parent, rank] = node, as one scatter; non-children land in a dropped last column
        flat = np.full((B, N * width + 1), -1, dtype=np.int64)
        flat[rows, np.where(real_child, parent_at * width + rank, N * width)] = node
        children = flat[:, :-1].reshape(B, N, width)
        arrays = (np.where(valid, tok, -1), np.where(real_child, par, -1), mask, depth, valid, children)
        t = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
        return TreeBatch(
            tokens=t[0], parents=t[1], mask=t[2], depth=t[3], valid=t[4], children=t[5],
            max_depth=max_depth, fanout=tuple(int(f) for f in fanout[:max_depth]),
        )  # fmt: skip

    @staticmethod
    def from_chains(root_tokens: Tensor, draft_tokens: Tensor) -> "TreeBatch":
        """Chains as trees: root_tokens [B], draft_tokens [B, γ] -1 padded (junk after the first -1
        is padding too, as `rejection_sample`). N = γ + 1 whatever the rows' lengths."""
        B, gamma = draft_tokens.shape
        real = (draft_tokens >= 0).cumprod(dim=1).bool()  # [B, γ]
        chain_parent = torch.arange(gamma, device=draft_tokens.device).expand(B, gamma)
        parents = torch.cat([draft_tokens.new_full((B, 1), -1), torch.where(real, chain_parent, -1)], dim=1)
        tokens = torch.cat([root_tokens.reshape(B, 1).to(draft_tokens), torch.where(real, draft_tokens, -1)], dim=1)
        return TreeBatch.from_parents(tokens, parents)


def batch_trees(trees: Sequence[DraftTree]) -> TreeBatch:
    """Pad one tree per row to the largest N: padded nodes have token -1 and parent -1."""
    if len(trees) == 0:
        raise ValueError("batch_trees needs at least one tree")
    N = max(t.num_nodes for t in trees)
    device = trees[0].tokens.device
    tokens = torch.full((len(trees), N), -1, dtype=torch.long, device=device)
    parents = torch.full((len(trees), N), -1, dtype=torch.long, device=device)
    for b, t in enumerate(trees):
        tokens[b, : t.num_nodes] = t.tokens
        parents[b, : t.num_nodes] = t.parents
    return TreeBatch.from_parents(tokens, parents)


def kept_slots(accepted_nodes: Tensor, cache_lengths: Tensor) -> Tensor:
    """Cache slots holding each row's accepted path: [B, D+1], -1 padded.

    ``accepted_nodes`` [B, D+1] is the verifier's path (root first, -1 padded); the target
    pass wrote node n of row b at slot ``cache_lengths[b] + n``. Those slots, moved to
    ``cache_lengths[b] .. cache_lengths[b] + k`` in path order, are the row's new history:
    the root and the k accepted drafts. The emitted recovered / bonus token is not among
    them: it is the next round's root, as in the chain engine.
    """
    return torch.where(accepted_nodes >= 0, cache_lengths[:, None] + accepted_nodes, -1)


def commit_paths(cache: "KVCache", accepted_nodes: Tensor, num_accepted: Tensor) -> None:
    """Compact each row's accepted path into contiguous slots, then ``commit(num_accepted + 1)``.

    Rows whose path is already contiguous (nodes 0..k, as for any chain) are not moved.
    Moving must come before the commit: it reads slots past the row's current length.
    One host sync to find the rows that move (one more if any do), then a per-row
    `KVCache.keep_slots` for each. The rejected nodes' slots lie past the new length and
    are overwritten by the next pass, as rejected chain drafts are.
    """
    k_max = accepted_nodes.shape[1]
    in_place = (accepted_nodes == torch.arange(k_max, device=accepted_nodes.device)) | (accepted_nodes < 0)
    moving = (~in_place.all(dim=1)).nonzero()[:, 0].tolist()
    if moving:
        lengths, counts = cache.lengths.tolist(), num_accepted.tolist()
        for row in moving:
            nodes = accepted_nodes[row, : counts[row] + 1]
            cache.keep_slots(row, lengths[row] + nodes, dst_start=lengths[row])
    cache.commit(num_accepted + 1)
