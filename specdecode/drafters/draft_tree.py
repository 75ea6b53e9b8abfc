"""Tree growth for any drafter that can score a masked block of nodes.

Owns: EAGLE-2 dynamic trees (`grow_tree`: expand level by level the ``topk`` frontier
nodes with the highest cumulative draft log-probability, then keep the ``budget`` best
nodes within each row's depth limit) and static trees (`fill_static_tree`: a ``speculative_token_tree`` shape
whose rank-r child is its parent's r-th likeliest token), handed to the verifier as a
`TreeBatch`.
Does not own: running the draft network (the caller's ``score`` function does).

Children are a node's ``topk`` likeliest tokens, distinct by construction, so the draft
is deterministic (one-hot q) and tree verification stays lossless. A child's cumulative
score never exceeds its parent's, so the best ``budget`` nodes (ties broken by depth)
always include each kept node's parent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from specdecode.drafters.base import Draft
from specdecode.core.tree import DraftTree, TreeBatch, TreeShape

# score(tokens [B, T], depth [B, T], mask [B, T, T], at [B, K], parent_states [B, T, F] | None)
#   -> (logits [B, K, V or Vd], states [B, K, F] | None):
# the draft's next-token logits at block positions ``at``, for a block of tree nodes
# (depth >= 1) that sees the committed history plus its ancestors in the block. A drafter
# whose node input is its parent's output (EAGLE feeds the parent's predicted feature)
# returns a state per ``at`` node and receives, per block node, its parent's state.
ScoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
    "tuple[torch.Tensor, torch.Tensor | None]",
]


@dataclass
class _Pool:
    """One row's candidate nodes (index = candidate id; parent -1 = the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    state_at: dict[int, int] = field(default_factory=dict)  # a scored node's column in the state bank
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def grow_tree(
    score: ScoreFn, root_logits: torch.Tensor, root_tokens: list[int], depth: int, topk: int, budget: int,
    root_states: torch.Tensor | None = None, vocab_ids: torch.Tensor | None = None, limits: list[int] | None = None,
) -> Draft:  # fmt: skip
    """A tree per row, at most ``depth`` deep (row b: ``limits[b]``, its own γ, where given) and
    ``budget`` draft nodes. root_logits [B, V or Vd];
    root_states [B, F]: the root's output state, for a drafter whose nodes take their parent's.
    ``vocab_ids`` [Vd]: the logits (the root's and ``score``'s) are over these tokens only (a
    draft vocabulary: the same tree as over the full logits with -inf elsewhere, cheaper)."""
    B, device = root_logits.shape[0], root_logits.device
    pools = [_Pool() for _ in range(B)]

    def best(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # top-k (log q, token id)
        logq, idx = torch.log_softmax(logits.float(), dim=-1).topk(min(topk, logits.shape[-1]), dim=-1)
        return logq, idx if vocab_ids is None else vocab_ids[idx]

    logq, tok = (t.tolist() for t in best(root_logits))  # [B][k], read once (not a device sync per row)
    frontier = [[p.add(t, -1, s) for t, s in zip(tok[b], logq[b])] for b, p in enumerate(pools)]
    # the output states of the root (column 0) and of every scored level's frontier, [B, 1 + levels · topk, F]
    bank = None if root_states is None else root_states[:, None]
    for _ in range(depth - 1):
        block = [sorted({n for f in fr for n in p.path(f)}) for p, fr in zip(pools, frontier)]
        T = max(len(nodes) for nodes in block)
        # built on the host as lists, one tensor each: every item write into a tensor is a dispatch
        tokens, depths, mask, at, parent_col = [], [], [], [], []
        for p, nodes, fr in zip(pools, block, frontier):
            where = {n: i for i, n in enumerate(nodes)}
            pad = T - len(nodes)
            tokens.append([p.tokens[n] for n in nodes] + [0] * pad)
            depths.append([p.depths[n] for n in nodes] + [1] * pad)
            rows = [[False] * T for _ in range(T)]
            for i, n in enumerate(nodes):
                for a in p.path(n):
                    rows[i][where[a]] = True
            for i in range(len(nodes), T):  # padding sees only itself
                rows[i][i] = True
            mask.append(rows)
            at.append([where[f] for f in fr] + [0] * (topk - len(fr)))
            if bank is not None:
                parent_col.append([p.state_at[p.parents[n]] if p.parents[n] >= 0 else 0 for n in nodes] + [0] * pad)
        parent_states = None  # [B, T, F]: each block node's parent's output state (the root's for padding)
        if bank is not None:
            col = torch.tensor(parent_col, device=bank.device)
            parent_states = bank.gather(1, col[:, :, None].expand(-1, -1, bank.shape[-1]))
        logits, states = score(
            torch.tensor(tokens, device=device), torch.tensor(depths, device=device),
            torch.tensor(mask, dtype=torch.bool, device=device), torch.tensor(at, device=device), parent_states,
        )  # fmt: skip
        logq, tok = (t.tolist() for t in best(logits))  # [B][k][k], read once per depth
        if states is not None and bank is not None:
            for b, p in enumerate(pools):
                p.state_at.update({f: bank.shape[1] + i for i, f in enumerate(frontier[b])})
            bank = torch.cat([bank, states.to(bank.dtype)], dim=1)
        for b, p in enumerate(pools):
            fresh = [
                p.add(t, f, p.scores[f] + s)
                for i, f in enumerate(frontier[b])
                for t, s in zip(tok[b][i], logq[b][i])
            ]
            frontier[b] = sorted(fresh, key=lambda n: -p.scores[n])[:topk]
    return _rerank(pools, root_tokens, budget, device, limits or [depth] * B)


def _rerank(pools: list[_Pool], root_tokens: list[int], budget: int, device: torch.device, limits: list[int]) -> Draft:
    """Keep each row's ``budget`` best nodes within its depth limit; number them by depth,
    likeliest sibling first. A level depends only on the ones above it, so a row limited to
    depth L gets the tree it would get grown alone to L (cut after ranking, deeper nodes would
    have taken places in its budget: a seeded row's samples then depended on its neighbours' γ)."""
    rows = []
    for p, limit in zip(pools, limits):
        within = [n for n in range(len(p.tokens)) if p.depths[n] <= limit]
        best = sorted(within, key=lambda n: (-p.scores[n], p.depths[n]))[:budget]
        kept = sorted(best, key=lambda n: (p.depths[n], -p.scores[n]))
        index = {n: i + 1 for i, n in enumerate(kept)}  # node 0 is the root
        rows.append(([p.tokens[n] for n in kept], [index[p.parents[n]] if p.parents[n] >= 0 else 0 for n in kept]))
    N = 1 + max(len(t) for t, _ in rows)
    tokens = [[root, *toks] + [-1] * (N - 1 - len(toks)) for (toks, _), root in zip(rows, root_tokens)]
    parents = [[-1, *pars] + [-1] * (N - 1 - len(pars)) for _, pars in rows]
    tree = TreeBatch.from_parents(torch.tensor(tokens, device=device), torch.tensor(parents, device=device))
    return Draft.from_tree(tree)


def fill_static_tree(score: ScoreFn, root_logits: torch.Tensor, root_tokens: list[int], shape: TreeShape) -> Draft:
    """Fill a static tree (Medusa / vLLM ``speculative_token_tree``): node i is the
    ``shape.rank[i]``-th likeliest token after its parent, level by level."""
    B, device, N = root_logits.shape[0], root_logits.device, shape.num_nodes
    parents = torch.tensor(shape.parents, dtype=torch.long)
    depth = torch.tensor(shape.depth, dtype=torch.long)
    mask = DraftTree.from_parents([0] * N, shape.parents).mask  # [N, N] ancestors-or-self
    tokens = torch.full((B, N), -1, dtype=torch.long, device=device)
    tokens[:, 0] = torch.tensor(root_tokens, device=device)
    width = max(shape.rank) + 1
    for d in range(1, max(shape.depth) + 1):
        level = [i for i in range(N) if shape.depth[i] == d]
        above = sorted({shape.parents[i] for i in level})
        if d == 1:
            logits = root_logits[:, None]  # [B, 1, V]: the root is the only parent
        else:
            block = [i for i in range(1, N) if shape.depth[i] < d]
            where = {n: k for k, n in enumerate(block)}
            at = torch.tensor([where[n] for n in above]).expand(B, -1)
            logits, _ = score(tokens[:, block], depth[block].expand(B, -1).to(device),
                              mask[block][:, block].expand(B, -1, -1).to(device), at.to(device), None)  # fmt: skip
        ranked = logits.topk(width, dim=-1).indices  # [B, len(above), width]
        slot = {n: k for k, n in enumerate(above)}
        for i in level:
            tokens[:, i] = ranked[:, slot[shape.parents[i]], shape.rank[i]]
    return Draft.from_tree(TreeBatch.from_parents(tokens, parents.to(device).expand(B, -1).contiguous()))
