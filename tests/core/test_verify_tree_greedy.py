"""Tree verification at temperature 0: the longest root path whose every token is the target's
argmax, which tree sampling also gives when p is one-hot (the sampled claims: test_verify_tree.py)."""

from __future__ import annotations

import torch

from specdecode.config import SamplingParams
from specdecode.core.sampling import logits_to_probs, make_generator, sampling_tensors
from specdecode.core.tree import DraftTree, TreeBatch, batch_trees
from specdecode.core.verify import greedy_verify, tree_greedy_verify, tree_rejection_sample
from tests.core.test_verify_tree import V, check_invariants


def naive_tree_greedy(argmax: list[int], tree: DraftTree) -> tuple[list[int], list[int]]:
    """Longest root path whose every node's token is the argmax at its parent; ties: smallest end node."""
    best = [0]
    stack = [[0]]
    while stack:
        path = stack.pop()
        if len(path) > len(best) or (len(path) == len(best) and path[-1] < best[-1]):
            best = path
        for c in tree.children[path[-1]]:
            if tree.tokens[c].item() == argmax[path[-1]]:
                stack.append(path + [c])
    tokens = [tree.tokens[i].item() for i in best[1:]] + [argmax[best[-1]]]
    return tokens, best


def test_tree_greedy_is_the_longest_matching_path():
    g = torch.Generator().manual_seed(11)
    trees, argmaxes = [], []
    for b in range(300):
        n = int(torch.randint(1, 16, (), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
        argmax = torch.randint(0, 4, (16,), generator=g)  # V = 4: repeats and matches are common
        tokens = [0] + [
            int(argmax[parents[i]]) if torch.rand((), generator=g) < 0.6 else int(torch.randint(0, 4, (), generator=g))
            for i in range(1, n)
        ]
        trees.append(DraftTree.from_parents(tokens, parents))
        argmaxes.append(argmax)
    batch = batch_trees(trees)
    target_argmax = torch.stack(argmaxes)[:, : batch.num_nodes]
    out, num_accepted, nodes = tree_greedy_verify(target_argmax, batch)
    p = torch.nn.functional.one_hot(target_argmax, 4).float()
    check_invariants(out, num_accepted, nodes, batch, p)
    for b, tree in enumerate(trees):
        tokens, path = naive_tree_greedy(target_argmax[b].tolist(), tree)
        assert out[b, : len(tokens)].tolist() == tokens and num_accepted[b].item() == len(path) - 1
        assert nodes[b, : len(path)].tolist() == path
    assert (num_accepted >= 2).sum() > 30  # deep matches, with ties among repeated siblings, were exercised


def test_tree_greedy_worked_example_and_sampling_agree_on_distinct_siblings():
    # table 10-17's tree [r, a, b, c, d]; the target's argmax after r is a, after a is d
    tree = DraftTree.from_parents([5, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    argmax = torch.tensor([[1, 4, 0, 0, 7]])  # argmax after d is 7: the bonus
    out, num_accepted, nodes = tree_greedy_verify(argmax, batch_trees([tree]))
    assert out.tolist() == [[1, 4, 7]] and num_accepted.tolist() == [2] and nodes.tolist() == [[0, 1, 4]]
    argmax = torch.tensor([[2, 4, 6, 0, 7]])  # b is the argmax, then 6 is recovered after it
    out, num_accepted, nodes = tree_greedy_verify(argmax, batch_trees([tree]))
    assert out.tolist() == [[2, 6, -1]] and num_accepted.tolist() == [1] and nodes.tolist() == [[0, 2, -1]]

    g = torch.Generator().manual_seed(12)
    B, N, W = 400, 8, 10  # W tokens, so siblings can be distinct
    logits = torch.randn(B, N, W, generator=g)
    target_argmax = logits.argmax(-1)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 4, 6]).expand(B, N)
    tokens = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):  # distinct siblings; the argmax is often among them, at any rank
        kids = torch.randperm(W, generator=g)[:3]
        if torch.rand((), generator=g) < 0.6 and target_argmax[b, 0] not in kids:
            kids[int(torch.randint(0, 3, (), generator=g))] = target_argmax[b, 0]
        tokens[b, 1:4] = kids
        tokens[b, 4] = target_argmax[b, 1]
        tokens[b, 5] = (target_argmax[b, 1] + 1) % W
        tokens[b, 6:] = torch.where(torch.rand(2, generator=g) < 0.5, target_argmax[b, [4, 6]], torch.randint(0, W, (2,), generator=g))
    trees = TreeBatch.from_parents(tokens, parents)
    want = tree_greedy_verify(target_argmax, trees)
    p = logits_to_probs(logits, *sampling_tensors([SamplingParams(temperature=0.0)] * B, "cpu"))
    spread = torch.softmax(torch.randn(B, N, W, generator=g), -1)
    for q in (None, torch.nn.functional.one_hot(tokens, W).float(), spread):
        got = tree_rejection_sample(p, q, trees, generator=make_generator(0, "cpu"))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert (want[1] >= 2).any()


def test_tree_greedy_on_chains_is_greedy_verify():
    g = torch.Generator().manual_seed(13)
    B, gamma = 500, 5
    target_argmax = torch.randint(0, V, (B, gamma + 1), generator=g)
    drafts = torch.where(torch.rand(B, gamma, generator=g) < 0.7, target_argmax[:, :gamma], torch.randint(0, V, (B, gamma), generator=g))
    drafts[torch.rand(B, gamma, generator=g) < 0.1] = -1
    want_out, want_n = greedy_verify(target_argmax, drafts)
    out, num_accepted, nodes = tree_greedy_verify(target_argmax, TreeBatch.from_chains(torch.zeros(B, dtype=torch.long), drafts))
    assert torch.equal(out, want_out) and torch.equal(num_accepted, want_n)
    assert (num_accepted == gamma).any()
