"""EAGLE-2 tree growth with a scripted scorer: shape, budget, distinct siblings, reranking."""

import pytest
import torch

from specdecode.drafters.draft_tree import grow_tree
from specdecode.drafters.registry import parse_spec

V = 8


def scripted_score(tokens, depths, mask, at, parent_states=None):
    # next-token logits depend only on the node's own token: token t prefers t+1, then t+2, ...
    B, K = at.shape
    last = tokens.gather(1, at)  # [B, K]
    logits = torch.full((B, K, V), -10.0)
    for r in range(3):
        logits.scatter_(2, ((last + 1 + r) % V)[:, :, None], 3.0 - r)
    return logits, None


def root_logits(B):
    lg = torch.full((B, V), -10.0)
    lg[:, 1], lg[:, 2], lg[:, 3] = 3.0, 2.0, 1.0
    return lg


def test_tree_shape_budget_and_siblings():
    draft = grow_tree(scripted_score, root_logits(2), [7, 5], depth=3, topk=2, budget=6)
    tree = draft.tree
    assert tree.tokens.shape == (2, 7)
    assert tree.tokens[:, 0].tolist() == [7, 5]
    for b in range(2):
        real = tree.valid[b].nonzero()[:, 0].tolist()
        assert len(real) == 7  # root + budget
        parents = tree.parents[b].tolist()
        for n in real[1:]:
            assert parents[n] < n
        for p in real:
            kids = [tree.tokens[b, c].item() for c in real[1:] if parents[c] == p]
            assert len(kids) == len(set(kids))
    # the likeliest path 1 -> 2 -> 3 is the first branch, depth 3
    assert tree.tokens[0, 1].item() == 1
    assert int(tree.depth[0].max()) == 3


def test_rerank_keeps_the_best_nodes_overall():
    draft = grow_tree(scripted_score, root_logits(1), [0], depth=4, topk=2, budget=4)
    tree = draft.tree
    # cumulative log-probs: 1 (-0.41), 1>2 (-0.82), 1>2>3 (-1.23), then the root's second
    # child 2 (-1.41) beats 1>2>3>4 (-1.64). Numbered by depth: [root, 1, 2 | 2 | 3].
    assert tree.tokens[0].tolist() == [0, 1, 2, 2, 3]
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 3]


def test_static_tree_fills_ranks_level_by_level():
    from specdecode.drafters.draft_tree import fill_static_tree
    from specdecode.core.tree import parse_token_tree

    shape = parse_token_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    tree = fill_static_tree(scripted_score, root_logits(2), [7, 6], shape).tree
    # root ranks: 1, 2; after t the ranks are t+1, t+2
    by_choice = dict(zip(shape.choices, tree.tokens[0].tolist()))
    assert by_choice == {(): 7, (0,): 1, (1,): 2, (0, 0): 2, (0, 1): 3, (1, 0): 3, (0, 0, 0): 3}
    assert tree.parents[1].tolist() == list(shape.parents)


@pytest.mark.parametrize(
    "tree,match",
    [([], "at least one"), ([(0, 0)], "prefix"), ([(0,), (0,)], "twice"), ("[(0,", "speculative_token_tree")],
)
def test_malformed_static_tree_is_one_line(tree, match):
    from specdecode.config import SpecDecodeError

    with pytest.raises(SpecDecodeError, match=match) as e:
        parse_spec({"method": "draft_model", "model": "x", "speculative_token_tree": tree})
    assert "\n" not in str(e.value)


def test_parent_states_reach_children():
    # A drafter whose node input is its parent's output (EAGLE): each scored node's state is
    # its depth; every block node must receive its parent's state (the root's for depth 1).
    seen = []

    def score(tokens, depths, mask, at, parent_states):
        seen.append((depths.clone(), parent_states.clone()))
        logits, _ = scripted_score(tokens, depths, mask, at)
        return logits, depths.gather(1, at)[:, :, None].float()

    grow_tree(score, root_logits(1), [0], depth=3, topk=2, budget=6, root_states=torch.zeros(1, 1))
    assert len(seen) == 2
    for depths, parent_states in seen:
        assert torch.equal(parent_states[..., 0], (depths - 1).float())
