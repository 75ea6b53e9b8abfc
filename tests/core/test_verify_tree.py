"""Tree verification is lossless: every emitted token follows the target, whatever tree the drafter built.

The statistical tests use a target that is Markov in (depth, last token): after a path
ending in token x at depth d its distribution is ``T[d, x]``, so a node's p depends on
the node (siblings with different tokens get different p). The exactly testable claims:
the first emitted token follows ``T[0, root]``, and for k >= 1, among rows that accepted
at least k drafts, the token at position k given the token before it (y) follows
``T[k, y]`` (the target's conditional after the whole prefix, which here depends on y and
k only). All groups are pooled into one chi-square test; seeds are fixed, the p-value
threshold is loose enough for a correct verifier, and `test_the_checks_have_power` shows
that two classic mistakes fail the same test by a wide margin.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specdecode.core import verify
from specdecode.config import SamplingParams
from specdecode.core.sampling import logits_to_probs, make_generator, sampling_tensors
from specdecode.core.tree import DraftTree, TreeBatch, batch_trees, parse_token_tree
from specdecode.core.verify import rejection_sample, tree_greedy_verify, tree_rejection_sample

V = 6
ROOT = 0
SHAPES = [  # 2-4 children per node, depth 2-3
    [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)],
    [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 0, 1)],
    [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)],
]


# ---------------------------------------------------------------------------------------------
# helpers


def check_invariants(out, num_accepted, nodes, trees: TreeBatch, p):
    """Exact: the path is a real root path, its tokens are emitted, then one token with p > 0, then -1."""
    B, width = out.shape
    assert nodes.shape == (B, width) and (nodes[:, 0] == 0).all()
    assert ((0 <= num_accepted) & (num_accepted <= trees.depth.max(dim=1).values)).all()
    pos = torch.arange(width)[None, :]
    on_path = pos <= num_accepted[:, None]
    assert ((nodes >= 0) == on_path).all()
    rows = torch.arange(B)[:, None].expand(B, width)
    parents_of = trees.parents[rows[:, 1:], nodes[:, 1:].clamp_min(0)]
    assert (parents_of[on_path[:, 1:]] == nodes[:, :-1][on_path[:, 1:]]).all(), "path is not parent-linked"
    assert trees.valid[rows[on_path], nodes[on_path]].all()
    accepted = pos[:, :-1] < num_accepted[:, None]
    path_tokens = trees.tokens[rows[:, 1:], nodes[:, 1:].clamp_min(0)]
    assert torch.equal(out[:, :-1][accepted], path_tokens[accepted])
    assert (out[pos > num_accepted[:, None]] == -1).all()
    last = out.gather(1, num_accepted[:, None])[:, 0]
    end = nodes.gather(1, num_accepted[:, None])[:, 0]
    assert (last >= 0).all()
    assert (p[torch.arange(B), end, last] > 0).all(), "emitted a token the target gives probability 0"


def pooled_chi2(groups) -> float:
    """One chi-square p-value over groups of (tokens [n], probs [V]); bins expecting < 5 are pooled."""
    stat, dof = 0.0, 0
    for tokens, probs in groups:
        counts = np.bincount(tokens.numpy(), minlength=len(probs)).astype(np.float64)
        expected = probs.double().numpy() * counts.sum()
        if counts[expected == 0].sum() > 0:
            return 0.0  # a token the target cannot produce there
        keep = expected > 0
        counts, expected = counts[keep], expected[keep]
        order = np.argsort(expected)
        counts, expected = list(counts[order]), list(expected[order])
        while len(expected) > 1 and expected[0] < 5:
            c0, e0 = counts.pop(0), expected.pop(0)
            counts[0] += c0
            expected[0] += e0
            order = np.argsort(expected)
            counts, expected = [counts[i] for i in order], [expected[i] for i in order]
        if len(expected) < 2:
            continue
        counts, expected = np.array(counts), np.array(expected)
        stat += float(((counts - expected) ** 2 / expected).sum())
        dof += len(expected) - 1
    return float(stats.chi2.sf(stat, dof)) if dof else 1.0


def follows_target(out, num_accepted, T) -> float:
    """p-value that position 0 ~ T[0, ROOT] and position k ~ T[k, out[k-1]] among rows with >= k accepted."""
    groups = [(out[:, 0], T[0, ROOT])]
    for k in range(1, out.shape[1]):
        for y in range(V):
            rows = (num_accepted >= k) & (out[:, k - 1] == y)
            if rows.sum() >= 30:
                groups.append((out[rows, k], T[k, y]))
    return pooled_chi2(groups)


def markov_tables(g, depth: int, filtered: bool):
    """Target T and drafter Q, [depth+1, V, V]: row [d, x] = next-token law after token x at depth d."""
    logits_t = torch.randn(depth + 1, V, V, generator=g) * 1.2
    logits_q = logits_t + torch.randn(depth + 1, V, V, generator=g)  # related: acceptance is mid-range
    if not filtered:
        return torch.softmax(logits_t, -1), torch.softmax(logits_q, -1)
    n = (depth + 1) * V
    params = sampling_tensors([SamplingParams(temperature=0.8, top_k=4, top_p=0.85)] * n, "cpu")
    T = logits_to_probs(logits_t.reshape(n, 1, V), *params).reshape(depth + 1, V, V)
    Q = logits_to_probs(logits_q.reshape(n, 1, V), *params).reshape(depth + 1, V, V)
    return T, Q


def draw_trees(drafter: str, T, Q, n: int, g):
    """n rows over SHAPES: (p [n, N, V], q [n, N, V] or None, TreeBatch).

    drafter: "topk" (q = None, the rank-r child is Q's r-th likeliest token after its parent,
    as a static-tree drafter fills ranks), "distinct" (q = None, random distinct siblings), "repeats" (q = None, random
    siblings that may repeat), "iid" (siblings i.i.d. from Q with replacement, q = Q),
    "without" (siblings drawn from Q without replacement, q = Q with earlier siblings
    removed: Sequoia), "without-wrong-q" (the same draws, q = plain Q: a drafter bug).
    """
    shapes = [parse_token_tree(s) for s in SHAPES]
    N = max(s.num_nodes for s in shapes)
    which = torch.arange(n) % len(shapes)
    tokens = torch.full((n, N), -1)
    parents = torch.full((n, N), -1)
    tokens[:, 0] = ROOT
    q = torch.zeros(n, N, V)
    for s_idx, shape in enumerate(shapes):
        rows = (which == s_idx).nonzero()[:, 0]
        m = len(rows)
        parents[rows, : shape.num_nodes] = torch.tensor(shape.parents)
        toks = torch.full((m, shape.num_nodes), ROOT)
        for i in range(1, shape.num_nodes):
            par = shape.parents[i]
            earlier = [j for j in range(1, i) if shape.parents[j] == par]  # earlier siblings
            law = Q[shape.depth[par], toks[:, par]]  # [m, V] the drafter's law after the parent
            if drafter in ("distinct", "repeats"):
                law = torch.ones(m, V)
            if drafter == "topk":  # deterministic: one-hot at the rank-th likeliest token
                ranked = law.argsort(dim=1, descending=True, stable=True)
                law = torch.zeros(m, V).scatter(1, ranked[:, shape.rank[i], None], 1.0)
            if drafter in ("distinct", "without", "without-wrong-q") and earlier:
                law = law.scatter(1, toks[:, earlier], 0.0)
                spent = law.sum(1, keepdim=True) == 0  # top-k/top-p left nothing: uniform over the rest
                law = torch.where(spent, torch.ones(m, V).scatter(1, toks[:, earlier], 0.0), law)
                law = law / law.sum(1, keepdim=True)
            toks[:, i] = torch.multinomial(law, 1, generator=g)[:, 0]
            q[rows, i] = Q[shape.depth[par], toks[:, par]] if drafter == "without-wrong-q" else law
        tokens[rows, : shape.num_nodes] = toks
    trees = TreeBatch.from_parents(tokens, parents)
    p = T[trees.depth, tokens.clamp_min(0)]  # [n, N, V]: the target's law after each node
    return p, (None if drafter in ("topk", "distinct", "repeats") else q), trees


# ---------------------------------------------------------------------------------------------
# losslessness


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "topk-topp"])
@pytest.mark.parametrize("drafter", ["topk", "distinct", "repeats", "iid", "without"])
def test_every_emitted_token_follows_the_target(drafter, filtered):
    g = torch.Generator().manual_seed(["topk", "distinct", "repeats", "iid", "without"].index(drafter) + 10 * filtered)
    T, Q = markov_tables(g, depth=3, filtered=filtered)
    p, q, trees = draw_trees(drafter, T, Q, 60_000, g)
    out, num_accepted, nodes = tree_rejection_sample(p, q, trees, generator=make_generator(7, "cpu"))
    check_invariants(out, num_accepted, nodes, trees, p)
    assert out.shape == (60_000, 4)
    assert (num_accepted >= 2).float().mean() > 0.1  # deep positions are exercised
    assert follows_target(out, num_accepted, T) > 1e-4


def test_the_checks_have_power(monkeypatch):
    """Two classic mistakes must fail the test above by a wide margin, at the same sample size."""
    g = torch.Generator().manual_seed(0)
    T, Q = markov_tables(g, depth=3, filtered=False)
    # a drafter that samples siblings without replacement but reports the plain q
    p, q, trees = draw_trees("without-wrong-q", T, Q, 60_000, g)
    out, num_accepted, _ = tree_rejection_sample(p, q, trees, generator=make_generator(7, "cpu"))
    assert follows_target(out, num_accepted, T) < 1e-12
    # a verifier that forgets the residual: after a rejection, the next sibling and the recovered token use p
    monkeypatch.setattr(verify, "RESIDUAL_EPS", 2.0)
    for drafter in ("topk", "iid"):
        p, q, trees = draw_trees(drafter, T, Q, 60_000, g)
        out, num_accepted, _ = tree_rejection_sample(p, q, trees, generator=make_generator(7, "cpu"))
        assert follows_target(out, num_accepted, T) < 1e-12, drafter


def test_first_level_acceptance_matches_the_formula():
    """Deterministic distinct children accept iff the target's token is among them: P = Σ_c p(x_c).
    k children i.i.d. from q: P(all rejected) = Π_j Σ max(0, r_j - q), r_{j+1} = norm(max(0, r_j - q))."""
    g = torch.Generator().manual_seed(3)
    T, Q = markov_tables(g, depth=3, filtered=False)
    n = 60_000
    p, _, trees = draw_trees("distinct", T, Q, n, g)
    _, num_accepted, _ = tree_rejection_sample(p, None, trees, generator=make_generator(1, "cpu"))
    root_kids = (trees.parents == 0) & trees.valid
    chance = (T[0, ROOT][trees.tokens.clamp_min(0)] * root_kids).sum(1)  # [n] per-row probability
    observed, expected = (num_accepted >= 1).double().sum(), chance.double().sum()
    assert abs(observed - expected) < 5 * (chance * (1 - chance)).double().sum().sqrt()

    p, q, trees = draw_trees("iid", T, Q, n, g)
    _, num_accepted, _ = tree_rejection_sample(p, q, trees, generator=make_generator(2, "cpu"))
    root_kids = ((trees.parents == 0) & trees.valid).sum(1)
    for k in root_kids.unique().tolist():
        r, rejected_all = T[0, ROOT].double(), 1.0
        for _ in range(k):
            rest = (r - Q[0, ROOT].double()).clamp_min(0)
            rejected_all *= rest.sum().item()
            r = rest / rest.sum()
        rows = root_kids == k
        rate = (num_accepted[rows] >= 1).double().mean().item()
        assert abs(rate - (1 - rejected_all)) < 5 * (rejected_all * (1 - rejected_all) / rows.sum().item()) ** 0.5


def test_a_rejected_token_repeated_by_a_sibling_is_rejected_too():
    p_root = torch.tensor([0.5, 0.3, 0.2, 0.0])
    tree = DraftTree.from_parents([0, 1, 1, 2], [-1, 0, 0, 0])  # siblings 1, 1, 2
    n = 40_000
    trees = batch_trees([tree] * n)
    p = p_root.expand(n, 4, 4).contiguous()
    out, num_accepted, nodes = tree_rejection_sample(p, None, trees, generator=make_generator(4, "cpu"))
    check_invariants(out, num_accepted, nodes, trees, p)
    assert (nodes[:, 1] != 2).all()  # node 2 repeats node 1's token: never accepted
    assert follows_target_single(out[:, 0], p_root) > 1e-4
    assert abs((nodes[:, 1] == 3).double().mean().item() - 0.2) < 0.01  # token 2 accepted with p(2)


def follows_target_single(tokens, probs) -> float:
    return pooled_chi2([(tokens, probs)])


# ---------------------------------------------------------------------------------------------
# chains, greedy and edge cases


def random_chains(B: int, gamma: int, g):
    p = torch.softmax(torch.randn(B, gamma + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, gamma, V, generator=g), -1)
    drafts = torch.randint(0, V, (B, gamma), generator=g)
    drafts[torch.rand(B, gamma, generator=g) < 0.15] = -1  # padding, and junk after it
    roots = torch.randint(0, V, (B,), generator=g)
    return p, q, drafts, roots


@pytest.mark.parametrize("gamma", [0, 1, 4])
def test_a_chain_tree_is_rejection_sample_token_for_token(gamma):
    g = torch.Generator().manual_seed(gamma)
    B = 2_000
    p, q, drafts, roots = random_chains(B, gamma, g)
    trees = TreeBatch.from_chains(roots, drafts)
    q_tree = torch.cat([torch.zeros(B, 1, V), q], dim=1)  # indexed by the child node
    per_row = [make_generator(s, "cpu") for s in range(B)]
    per_row_again = [make_generator(s, "cpu") for s in range(B)]
    for chain_q, tree_q in ((None, None), (q, q_tree)):
        for gen_a, gen_b in ((make_generator(5, "cpu"), make_generator(5, "cpu")), (per_row, per_row_again)):
            want_out, want_n = rejection_sample(p, chain_q, drafts, generator=gen_a)
            out, num_accepted, nodes = tree_rejection_sample(p, tree_q, trees, generator=gen_b)
            width = out.shape[1]
            assert torch.equal(out, want_out[:, :width]) and (want_out[:, width:] == -1).all()
            assert torch.equal(num_accepted, want_n)
            assert torch.equal(nodes[nodes >= 0], torch.arange(width).expand_as(nodes)[nodes >= 0])
    assert out.shape[0] == B


def test_edge_cases_without_nan_or_zero_probability_tokens():
    n = 4_000
    star = DraftTree.from_parents([0, 1, 2], [-1, 0, 0])
    trees = batch_trees([star] * n)

    def run(p_root, q_children=None):
        p = torch.tensor(p_root).expand(n, 3, -1).contiguous()
        q = None
        if q_children is not None:
            q = torch.cat([torch.zeros(1, len(p_root)), torch.tensor(q_children)]).expand(n, 3, -1).contiguous()
        out, num_accepted, nodes = tree_rejection_sample(p, q, trees, generator=make_generator(9, "cpu"))
        check_invariants(out, num_accepted, nodes, trees, p)
        return out, nodes

    # p(x) = 0 for both children: never accepted, whatever q says
    for q in (None, [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]):
        out, nodes = run([1.0, 0.0, 0.0], q)
        assert (nodes[:, 1] == -1).all() and (out[:, 0] == 0).all()
    # the drafter gives its token q = 0: accepted whenever p > 0
    _, nodes = run([0.0, 0.5, 0.5], [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert (nodes[:, 1] == 1).all()
    # q above p everywhere (float error in q): the residual is noise -> p, no NaN; token 2 has p = 0
    out, nodes = run([0.5, 0.5, 0.0], [[0.5, 0.6, 0.0], [0.5, 0.6, 0.0]])
    rejected = nodes[:, 1] == -1
    assert 0 < rejected.sum() < n and set(out[rejected, 0].tolist()) <= {0, 1}
    # a greedy target whose argmax is the second child: the first is rejected, the second accepted
    _, nodes = run([0.0, 0.0, 1.0], None)
    assert (nodes[:, 1] == 2).all()
    # a root alone: one bonus token from p[root]
    p = torch.tensor([0.0, 0.25, 0.75]).expand(n, 1, 3).contiguous()
    lone = batch_trees([DraftTree.from_chain(0, [])] * n)
    out, num_accepted, nodes = tree_rejection_sample(p, None, lone, generator=make_generator(1, "cpu"))
    assert out.shape == (n, 1) and (num_accepted == 0).all() and (nodes == 0).all()
    assert follows_target_single(out[:, 0], torch.tensor([0.0, 0.25, 0.75, 0, 0, 0])) > 1e-4


def _unpadded(t: torch.Tensor) -> list[int] | int:
    return t.item() if t.dim() == 0 else [x for x in t.tolist() if x != -1]


@pytest.mark.parametrize("first", [2, 0])
def test_rows_are_reproducible_whatever_the_batch(first):
    """Row 0 with its own seed gives the same tokens alone or next to other trees, smaller or larger."""
    g = torch.Generator().manual_seed(14)
    trees = [DraftTree.from_paths(i, SHAPES[i], torch.randint(0, V, (len(SHAPES[i]),), generator=g)) for i in (2, 0)]
    mine, other = trees[0 if first == 2 else 1], trees[1 if first == 2 else 0]
    others = [DraftTree.from_chain(2, [3, 4]), other]
    N = max(t.num_nodes for t in trees)
    p = torch.softmax(torch.randn(3, N, V, generator=g), -1)
    q = torch.softmax(torch.randn(3, N, V, generator=g), -1)
    n = mine.num_nodes
    alone_gen, batch_gens = [make_generator(77, "cpu")], [make_generator(77, "cpu"), make_generator(1, "cpu"), None]
    alone, together = [], []
    for _ in range(40):
        r = tree_rejection_sample(p[:1, :n], q[:1, :n], batch_trees([mine]), generator=alone_gen)
        alone.append([_unpadded(t[0]) for t in r])
        r = tree_rejection_sample(p, q, batch_trees([mine, *others]), generator=batch_gens)
        together.append([_unpadded(t[0]) for t in r])
    assert alone == together
    assert len({str(a) for a in alone}) > 3


def test_padding_inside_a_tree_draws_nothing():
    """A budget cuts a row's deeper nodes out of a wider proposal and leaves gaps in its numbering
    ([r, a, b, -, -, c, -] where alone it is [r, a, b, c]): the row must draw the same numbers, so
    a seeded request samples the same tokens whatever depth other rows asked the drafter for."""
    g = torch.Generator().manual_seed(3)
    compact = TreeBatch.from_parents(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[-1, 0, 0, 1]]))
    gapped = TreeBatch.from_parents(torch.tensor([[0, 1, 2, 0, 0, 3, 0]]), torch.tensor([[-1, 0, 0, -1, -1, 1, -1]]))
    p_c = torch.softmax(torch.randn(1, 4, V, generator=g), -1)
    q_c = torch.softmax(torch.randn(1, 4, V, generator=g), -1)
    where = [0, 1, 2, 5]  # the compact nodes' places in the gapped tree
    p_g, q_g = torch.zeros(1, 7, V), torch.zeros(1, 7, V)
    p_g[:, where], q_g[:, where] = p_c, q_c
    p_g[:, [3, 4, 6]] = 1.0 / V  # padding: never read
    for q_compact, q_gapped in ((None, None), (q_c, q_g)):
        a_gen, b_gen = make_generator(11, "cpu"), make_generator(11, "cpu")
        for _ in range(30):
            out_a, n_a, nodes_a = tree_rejection_sample(p_c, q_compact, compact, generator=[a_gen])
            out_b, n_b, nodes_b = tree_rejection_sample(p_g, q_gapped, gapped, generator=[b_gen])
            assert torch.equal(out_a, out_b) and torch.equal(n_a, n_b)
            assert [where[i] for i in nodes_a[0].tolist() if i >= 0] == [i for i in nodes_b[0].tolist() if i >= 0]


def test_bad_shapes_are_rejected():
    trees = batch_trees([DraftTree.from_chain(0, [1, 2])] * 2)
    p = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match="trees must be"):
        tree_rejection_sample(torch.full((2, 4, 4), 0.25), None, trees)
    with pytest.raises(ValueError, match="q must be"):
        tree_rejection_sample(p, torch.full((2, 2, 4), 0.25), trees)
    with pytest.raises(ValueError, match="one generator per row"):
        tree_rejection_sample(p, None, trees, generator=[None])
    with pytest.raises(ValueError, match="trees must be"):
        tree_greedy_verify(torch.zeros(2, 2, dtype=torch.long), trees)
