"""Draft trees: masks, depths and paths from every constructor, batching, and cache compaction.

The spec's table 10-17 is checked cell by cell; the three constructors must describe
the same tree; a malformed ``speculative_token_tree`` fails with one line; and a tiny
model run on a padded tree batch must give, at every node, the logits of that node's
path run as a plain sequence, also after the accepted path is compacted in the cache.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.config import SpecDecodeError
from specdecode.cache.kv_cache import ContiguousKVCache
from specdecode.model.transformer import ModelConfig, Transformer
from specdecode.core.tree import DraftTree, TreeBatch, batch_trees, commit_paths, kept_slots, parse_token_tree

# Table 10-17: nodes [r, a, b, c, d]; a, b children of r; c, d children of a.
TABLE_10_17 = [
    [1, 0, 0, 0, 0],
    [1, 1, 0, 0, 0],
    [1, 0, 1, 0, 0],
    [1, 1, 0, 1, 0],
    [1, 1, 0, 0, 1],
]
R, A, B, C, D = 10, 11, 12, 13, 14  # the five tokens


def naive_ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_seed_table_10_17_from_every_constructor():
    want = torch.tensor(TABLE_10_17, dtype=torch.bool)
    trees = [
        DraftTree.from_parents([R, A, B, C, D], [-1, 0, 0, 1, 1]),
        DraftTree.from_paths(R, [(0,), (1,), (0, 0), (0, 1)], [A, B, C, D]),
        DraftTree.from_paths(R, [(0,), (0, 0), (1,), (0, 1)], [A, C, B, D]),  # vLLM-style order
        DraftTree.from_paths(R, "[(0, 1), (1,), (0,), (0, 0)]", [D, B, A, C]),  # any order, as a string
    ]
    for t in trees:
        assert torch.equal(t.mask, want)
        assert t.tokens.tolist() == [R, A, B, C, D]
        assert t.parents.tolist() == [-1, 0, 0, 1, 1]
        assert t.depth.tolist() == [0, 1, 1, 2, 2]
        assert t.children == ((1, 2), (3, 4), (), (), ())
        assert t.paths == ((0, 2), (0, 1, 3), (0, 1, 4))  # r→b, r→a→c, r→a→d
        assert t.choices == ((), (0,), (1,), (0, 0), (0, 1))


def test_parse_token_tree_gives_parents_depth_and_rank():
    shape = parse_token_tree([(1,), (0,), (0, 0), (0, 0, 0), (1, 0), (0, 2)])  # a rank gap under (0,)
    assert shape.choices == ((), (0,), (1,), (0, 0), (0, 2), (1, 0), (0, 0, 0))
    assert shape.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert shape.depth == (0, 1, 1, 2, 2, 2, 3)
    assert shape.rank == (-1, 0, 1, 0, 2, 0, 0)
    assert shape.num_nodes == 7
    assert parse_token_tree([[0], [0, 0]]).parents == (-1, 0, 1)  # lists, as JSON gives them


@pytest.mark.parametrize(
    "choices, needle",
    [
        ([], "at least one"),
        ((), "at least one"),
        ([(0,), (0, 1, 0)], "prefix (0, 1)"),
        ([(1, 0)], "prefix (1,)"),
        ([(0,), (1,), (0,)], "twice"),
        ([(0), (1)], "(0,) for a one-element tuple"),  # the classic: (0) is an int
        ([(0,), "01"], "tuples of ints"),
        ([(0,), (0, -1)], "tuples of ints"),
        ([(0,), (True,)], "tuples of ints"),
        ([(0,), (0.0,)], "tuples of ints"),
        ([(0,), ()], "root"),
        ("[(0,), (0, 0", "not a list"),
        ("7", "list of tuples"),
        (5, "list of tuples"),
    ],
)
def test_malformed_token_trees_raise_one_line(choices, needle):
    with pytest.raises(SpecDecodeError) as info:
        parse_token_tree(choices)
    message = str(info.value)
    assert needle in message and "\n" not in message
    with pytest.raises(SpecDecodeError):  # from_paths validates the same way
        DraftTree.from_paths(0, choices, [])


def test_from_paths_checks_the_token_count_and_from_parents_the_structure():
    with pytest.raises(SpecDecodeError, match="2 nodes but 3 tokens"):
        DraftTree.from_paths(0, [(0,), (1,)], [1, 2, 3])
    for tokens, parents in (([1, 2], [-1, 1]), ([1, 2], [0, -1]), ([1, 2, 3], [-1, 0, 2]), ([1], [-1, 0]), ([], [])):
        with pytest.raises(ValueError):
            DraftTree.from_parents(tokens, parents)
    with pytest.raises(ValueError, match=">= 0"):
        DraftTree.from_parents([1, -1], [-1, 0])


def test_chain_tree_is_the_causal_mask():
    t = DraftTree.from_chain(5, [6, 7, 8, 9])
    assert torch.equal(t.mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert t.depth.tolist() == [0, 1, 2, 3, 4]
    assert t.paths == ((0, 1, 2, 3, 4),) and t.tokens.tolist() == [5, 6, 7, 8, 9]
    assert t.choices == ((), (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    root_only = DraftTree.from_chain(5, [])
    assert root_only.paths == ((0,),) and root_only.mask.tolist() == [[True]]


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def check_agreement(parents: list[int], seed: int) -> None:
    """from_parents vs from_paths (choices listed in a shuffled order) vs the naive definition."""
    rng = random.Random(seed)
    n = len(parents)
    tokens = [rng.randrange(1000) for _ in range(n)]
    by_parents = DraftTree.from_parents(tokens, parents)
    for i in range(n):  # mask and depth from the definition
        ancestors = naive_ancestors(parents, i)
        assert by_parents.mask[i].nonzero()[:, 0].tolist() == sorted(ancestors)
        assert by_parents.depth[i].item() == len(ancestors) - 1
    if n == 1:  # a root alone has no speculative_token_tree
        assert by_parents.paths == ((0,),)
        return
    choices = list(by_parents.choices[1:])
    order = list(range(n - 1))
    rng.shuffle(order)
    by_paths = DraftTree.from_paths(tokens[0], [choices[k] for k in order], [tokens[k + 1] for k in order])
    # the same tree up to renumbering: map each from_paths node to the from_parents node with its choice
    where = {c: i for i, c in enumerate(by_parents.choices)}
    perm = torch.tensor([where[c] for c in by_paths.choices])
    assert torch.equal(by_paths.mask, by_parents.mask[perm][:, perm])
    assert torch.equal(by_paths.depth, by_parents.depth[perm])
    assert torch.equal(by_paths.tokens, by_parents.tokens[perm])
    assert {tuple(perm[list(p)].tolist()) for p in by_paths.paths} == set(by_parents.paths)
    assert set(by_parents.paths) == {(*sorted(naive_ancestors(parents, leaf)),) for leaf in range(n) if leaf not in parents}
    # a breadth-first, rank-ordered parent array is kept as is
    canonical = DraftTree.from_parents(by_paths.tokens, by_paths.parents)
    assert canonical.paths == by_paths.paths and torch.equal(canonical.mask, by_paths.mask)
    # and the batch constructor agrees with the single-tree one
    batch = batch_trees([by_parents])
    assert torch.equal(batch.mask[0], by_parents.mask) and torch.equal(batch.depth[0], by_parents.depth)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, 2**31))))
def test_constructors_agree_on_random_trees(n_seed):
    n, seed = n_seed
    check_agreement(random_parents(random.Random(seed), n), seed)


def test_constructors_agree_on_the_shapes_drafters_use():
    check_agreement([-1, 0, 1, 2, 3, 4, 5], 0)  # a chain
    check_agreement([-1] + [0] * 9, 1)  # a star: top-9 at one position
    medusa = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 2), (2, 0), (0, 0, 1), (1, 1)]
    check_agreement(list(parse_token_tree(medusa).parents), 2)


def test_batching_pads_and_keeps_every_tree():
    trees = [
        DraftTree.from_parents([R, A, B, C, D], [-1, 0, 0, 1, 1]),
        DraftTree.from_chain(7, [8, 9]),
        DraftTree.from_chain(3, []),
        DraftTree.from_paths(1, [(0,), (1,), (2,), (1, 0)], [4, 5, 6, 7]),
    ]
    batch = batch_trees(trees)
    assert batch.batch_size == 4 and batch.num_nodes == 5
    assert batch.max_depth == 2 and batch.fanout == (3, 2)  # the root of tree 3 has 3 children; a has 2
    for b, t in enumerate(trees):
        n = t.num_nodes
        assert torch.equal(batch.tokens[b, :n], t.tokens) and (batch.tokens[b, n:] == -1).all()
        assert torch.equal(batch.parents[b, :n], t.parents) and (batch.parents[b, n:] == -1).all()
        assert torch.equal(batch.mask[b, :n, :n], t.mask)
        assert torch.equal(batch.depth[b, :n], t.depth) and (batch.depth[b, n:] == 0).all()
        assert batch.valid[b].tolist() == [True] * n + [False] * (5 - n)
        # padded nodes see only themselves, and no real node sees them
        assert torch.equal(batch.mask[b, n:, :], torch.eye(5, dtype=torch.bool)[n:])
        assert not batch.mask[b, :n, n:].any()
        for i in range(5):
            kids = [c for c in batch.children[b, i].tolist() if c >= 0]
            assert kids == (list(t.children[i]) if i < n else [])
    assert batch.children.shape == (4, 5, 3)
    lengths = torch.tensor([10, 0, 4, 7])
    assert torch.equal(batch.positions(lengths), lengths[:, None] + batch.depth)
    with pytest.raises(ValueError):
        batch_trees([])


def test_tensor_constructors_agree_with_batch_trees():
    rng = random.Random(3)
    trees = [DraftTree.from_parents([rng.randrange(50) for _ in range(n)], random_parents(rng, n)) for n in (1, 6, 13, 9)]
    want = batch_trees(trees)
    N = want.num_nodes
    tokens = torch.full((4, N), 99)  # padding tokens are ignored and reported as -1
    parents = torch.full((4, N), -1)
    for b, t in enumerate(trees):
        tokens[b, : t.num_nodes], parents[b, : t.num_nodes] = t.tokens, t.parents
    got = TreeBatch.from_parents(tokens, parents)
    for name in ("tokens", "parents", "mask", "depth", "valid", "children"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.max_depth, got.fanout) == (want.max_depth, want.fanout)

    drafts = torch.tensor([[5, 6, 7], [8, -1, 9], [-1, -1, -1]])  # junk after the first -1 is padding
    chains = TreeBatch.from_chains(torch.tensor([1, 2, 3]), drafts)
    single = batch_trees([DraftTree.from_chain(1, [5, 6, 7]), DraftTree.from_chain(2, [8]), DraftTree.from_chain(3, [])])
    for name in ("tokens", "parents", "mask", "depth", "valid", "children"):
        assert torch.equal(getattr(chains, name), getattr(single, name)), name
    assert chains.max_depth == 3 and chains.fanout == (1, 1, 1)
    only_roots = TreeBatch.from_chains(torch.tensor([1, 2]), torch.full((2, 2), -1))
    assert only_roots.num_nodes == 3 and only_roots.max_depth == 0 and only_roots.fanout == ()


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ([[1, 2, 3]], [[-1, 0, 2]]),  # parent not before the node
        ([[1, 2, 3]], [[-1, -1, 1]]),  # a real node under a padding node
        ([[1, -5, 3]], [[-1, 0, 1]]),  # a real node without a token
        ([[-1, 2]], [[-1, 0]]),  # a root without a token
        ([[1, 2]], [[0, 0]]),  # a root with a parent
    ],
)
def test_malformed_tree_batches_raise(tokens, parents):
    with pytest.raises(ValueError, match="malformed tree batch"):
        TreeBatch.from_parents(torch.tensor(tokens), torch.tensor(parents))


def test_kept_slots_and_commit_paths_compact_the_cache():
    cache = ContiguousKVCache(num_layers=2, batch_size=3, num_kv_heads=1, head_dim=1, capacity=16, dtype=torch.float32, device="cpu")
    slot_ids = torch.arange(16, dtype=torch.float32)
    cache.k[..., 0] = slot_ids  # every slot remembers where it was
    cache.v[..., 0] = -slot_ids
    cache.lengths = torch.tensor([3, 5, 2])
    accepted = torch.tensor([[0, 2, 4, -1], [0, 1, -1, -1], [0, -1, -1, -1]])
    num_accepted = torch.tensor([2, 1, 0])
    assert kept_slots(accepted, cache.lengths).tolist() == [[3, 5, 7, -1], [5, 6, -1, -1], [2, -1, -1, -1]]
    commit_paths(cache, accepted, num_accepted)
    assert cache.lengths.tolist() == [6, 7, 3]
    assert cache.k[1, 0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 7]  # row 0: nodes 2 and 4 moved down
    assert cache.v[0, 0, 0, :6, 0].tolist() == [-0.0, -1, -2, -3, -5, -7]
    assert torch.equal(cache.k[:, 1:, 0, :, 0], slot_ids.expand(2, 2, 16))  # contiguous rows untouched


def tiny_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=128)  # fmt: skip
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for w in model.parameters():  # O(1) weights so every position matters
            w.normal_(0, 0.5)
    return model


@torch.no_grad()
def test_model_on_a_tree_batch_matches_each_path_and_compaction_keeps_it():
    """The engine's call: every node's logits = its path run as a sequence; after commit_paths the
    cache holds the accepted path, so the next token's logits match the plain sequence too."""
    model = tiny_model(0)
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, 40, (n,), generator=g) for n in (6, 9)]
    trees = [
        DraftTree.from_parents(torch.randint(0, 40, (5,), generator=g), [-1, 0, 0, 1, 1]),  # table 10-17
        DraftTree.from_paths(int(torch.randint(0, 40, (), generator=g)), [(0,), (1,), (1, 0), (1, 0, 0)],
                             torch.randint(0, 40, (4,), generator=g)),  # fmt: skip
    ]
    batch = batch_trees(trees)
    cache = model.new_cache(2, 32)
    padded = torch.zeros(2, 9, dtype=torch.long)
    for b, p in enumerate(prefixes):
        padded[b, : len(p)] = p
    model(padded, torch.arange(9).expand(2, -1), cache)
    cache.commit(torch.tensor([6, 9]))

    def plain(seq):
        fresh = model.new_cache(1, 32)
        return model(seq[None], torch.arange(len(seq))[None], fresh)[0]

    logits = model(batch.tokens.clamp(min=0), batch.positions(cache.lengths), cache, block_mask=batch.mask)
    for b, t in enumerate(trees):
        for i in range(t.num_nodes):
            path_tokens = t.tokens[t.mask[i]]  # ancestors in index order = root-to-node order
            want = plain(torch.cat([prefixes[b], path_tokens]))[-1]
            torch.testing.assert_close(logits[b, i], want, atol=1e-4, rtol=0)

    accepted = torch.tensor([[0, 1, 4, -1], [0, 2, 3, 4]])  # r→a→d, and the deep branch: both move
    num_accepted = torch.tensor([2, 3])
    commit_paths(cache, accepted, num_accepted)
    nxt = torch.tensor([[7], [8]])
    got = model(nxt, cache.lengths[:, None], cache)[:, 0]
    for b, t in enumerate(trees):
        kept = t.tokens[accepted[b, : num_accepted[b] + 1]]
        want = plain(torch.cat([prefixes[b], kept, nxt[b]]))[-1]
        torch.testing.assert_close(got[b], want, atol=1e-4, rtol=0)
