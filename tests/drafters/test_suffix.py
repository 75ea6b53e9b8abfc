"""The suffix drafter needs no model: test its trees, proposals and cache directly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.drafters.registry import parse_spec
from specdecode.drafters.base import DrafterContext
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.drafters.suffix_tree import (
    GlobalCache,
    SuffixTree,
    best_speculation,
    spec_budget,
    speculate,
    state_match_nodes,
)
from specdecode.core.batch import Batch

seqs = st.lists(st.integers(0, 4), min_size=1, max_size=30)


def tree_of(*sequences, depth=4):
    tree = SuffixTree(depth)
    for s in sequences:
        tree.extend([], s)
    return tree


def substrings(sequences, depth):
    """{substring: occurrences} for every substring of length <= depth: what the trie must hold."""
    out: dict[tuple, int] = {}
    for s in sequences:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def flatten(d, prefix=()):
    out = {}
    for t, (count, sub) in d.items():
        out[prefix + (t,)] = count
        out.update(flatten(sub, prefix + (t,)))
    return out


# -- the tree ------------------------------------------------------------------------


def test_counts_and_depth_bound():
    tree = tree_of([1, 2, 1, 2, 3], depth=3)
    paths = flatten(tree.as_dict())
    assert paths[(1,)] == 2 and paths[(2,)] == 2 and paths[(3,)] == 1
    assert paths[(1, 2)] == 2 and paths[(1, 2, 1)] == 1 and paths[(1, 2, 3)] == 1
    assert max(len(p) for p in paths) == 3  # (1, 2, 1, 2) is deeper than the bound
    assert tree.find([1, 2]).out == 2  # followed by 1 once and by 3 once
    assert tree.find([2, 3]).out == 0  # the sequence ends there


@settings(max_examples=60, deadline=None)
@given(st.lists(seqs, min_size=1, max_size=4), st.integers(2, 6), st.data())
def test_tree_holds_every_bounded_substring_count_also_when_extended_in_chunks(sequences, depth, data):
    tree = SuffixTree(depth)
    for s in sequences:
        state, i = [], 0
        while i < len(s):  # append in random chunks, as rounds commit tokens
            j = data.draw(st.integers(i + 1, len(s)))
            state = tree.extend(state, s[i:j])
            i = j
        assert [tree.find(s[len(s) - k :]) for k in range(1, len(state) + 1)] == state
    assert flatten(tree.as_dict()) == substrings(sequences, depth)


@settings(max_examples=60, deadline=None)
@given(seqs, seqs, st.integers(2, 6))
def test_match_is_the_longest_suffix_seen_with_a_continuation(history, context, depth):
    tree = tree_of(history, depth=depth)
    matches = tree.match_nodes(context)
    L = len(matches)
    seen = substrings([history], depth)
    continued = {s[:-1] for s in seen if len(s) >= 2} | ({()} if history else set())
    want = max(k for k in range(min(len(context), depth - 1) + 1) if tuple(context[len(context) - k :]) in continued)
    assert L == want
    assert all(m is tree.find(context[len(context) - k :]) for k, m in enumerate(matches, start=1))
    # A sequence's own state gives the same answer for its own context.
    own = SuffixTree(depth)
    state = own.extend([], history)
    assert state_match_nodes(state, depth) == own.match_nodes(history)


# -- proposals -----------------------------------------------------------------------


def test_speculate_scores_by_frequency_likeliest_child_first():
    # after 7: 8 three times (then 9 twice, 5 once), 6 once
    tree = tree_of([7, 8, 9], [7, 8, 9], [7, 8, 5], [7, 6], depth=4)
    spec = speculate(tree.find([7]), budget=10, min_prob=0.0)
    assert spec.tokens == [8, 9, 6, 5] and spec.parents == [0, 1, 0, 1]
    assert spec.probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3, 1 / 4, 3 / 4 * 1 / 3])
    assert spec.score == pytest.approx(sum(spec.probs))
    assert speculate(tree.find([7]), budget=2, min_prob=0.0).tokens == [8, 9]
    assert speculate(tree.find([7]), budget=10, min_prob=0.3).tokens == [8, 9]  # 1/4 and 1/4 dropped
    assert speculate(tree.find([7]), budget=0, min_prob=0.0).tokens == []


@settings(max_examples=100, deadline=None)
@given(st.lists(seqs, min_size=1, max_size=4), st.integers(0, 12), st.floats(0, 1), st.integers(2, 8))
@example([[0, 0, 0, 0, 0, 0, 0, 4, 4, 0, 4, 4, 0, 4, 4, 0, 4]], 4, 0.0, 3)  # 0.4 * 3 / 3 > 0.4 in floats
def test_proposal_tree_shape(sequences, budget, min_prob, depth):
    tree = tree_of(*sequences, depth=depth)
    for match in tree.root.children.values():
        spec = speculate(match, budget, min_prob)
        assert len(spec.tokens) <= budget
        assert all(p >= min_prob for p in spec.probs)
        assert spec.probs == sorted(spec.probs, reverse=True)  # so each sibling list is likeliest first
        paths = {0: ()}
        for i, (t, parent) in enumerate(zip(spec.tokens, spec.parents), start=1):
            assert 0 <= parent < i  # parents before children
            paths[i] = paths[parent] + (t,)
        assert len(set(paths.values())) == len(paths)  # siblings distinct
        anchor = next(t for t, n in tree.root.children.items() if n is match)
        assert all(tree.find((anchor, *p)) is not None for p in paths.values())  # real continuations


def test_adaptive_length_grows_with_the_match():
    assert [spec_budget(k, cap=8, factor=1.0) for k in (0, 1, 3, 8, 20)] == [0, 1, 3, 8, 8]
    assert spec_budget(3, cap=32, factor=2.5) == 7
    assert spec_budget(3, cap=32, factor=1e308) == 32  # a huge finite factor: the cap (was an OverflowError)
    text = list(range(40))
    tree = tree_of(text, depth=24)
    for k in (1, 2, 5, 12, 20):  # a context whose last k tokens match
        spec = best_speculation(tree.match_nodes([99, *text[:k]]), 24, 32, 1.0, 0.1)
        assert spec.tokens == text[k : k + len(spec.tokens)]
        assert len(spec.tokens) == min(k, 12)  # 12 = the most a depth-24 tree leaves below a match
        assert spec.is_chain


# -- the global cache ----------------------------------------------------------------


def test_global_cache_lru_eviction_and_exact_removal():
    a, b, c = [1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 1, 2]
    cache = GlobalCache(max_depth=3, max_requests=2)
    ia = cache.add(a)
    cache.add(b)
    cache.touch(ia)  # a used after b: b is least recently used
    cache.add(c)
    assert list(cache.entries.values()) == [tuple(a), tuple(c)]
    assert cache.tree.as_dict() == tree_of(a, c, depth=3).as_dict()
    cache.remove(ia)
    assert cache.tree.as_dict() == tree_of(c, depth=3).as_dict()
    assert GlobalCache(3, 0).add(a) == -1  # 0 disables the global tree


@settings(max_examples=60, deadline=None)
@given(st.lists(seqs, min_size=1, max_size=8), st.integers(1, 4))
def test_global_cache_holds_exactly_its_entries(outputs, cap):
    cache = GlobalCache(max_depth=4, max_requests=cap)
    for out in outputs:
        cache.add(out)
    assert list(cache.entries.values()) == [tuple(o) for o in outputs[-cap:]]
    assert flatten(cache.tree.as_dict()) == substrings(outputs[-cap:], 4)
    for entry in list(cache.entries):
        cache.remove(entry)
    assert cache.tree.root.children == {} and cache.tree.root.out == 0


def test_proposals_touch_the_entry_they_came_from():
    spec = parse_spec({"method": "suffix", "suffix_decoding_max_cached_requests": 2})
    drafter = SuffixDrafter(spec, DrafterContext(target=None, dtype=torch.float32, device=torch.device("cpu")))
    a, b = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24]
    ia = drafter.cache.add(a)
    drafter.cache.add(b)
    batch = make_batch([[10, 11, 12]])
    drafter.prefill(batch, list(range(len(batch))))
    draft = drafter.propose(batch, 8)
    assert draft.tokens[0].tolist()[:2] == [13, 14] and drafter.stats.global_ == 1
    assert next(reversed(drafter.cache.entries)) == ia  # a is now the most recently used


# -- the drafter ---------------------------------------------------------------------


def make_batch(prompts, max_tokens=16):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    seqs = [Batch.new_sequence(i, p, params, torch.device("cpu")) for i, p in enumerate(prompts)]
    return Batch(seqs, capacity=64, device=torch.device("cpu"))


def make_drafter(**options):
    spec = parse_spec({"method": "suffix", **options})
    return SuffixDrafter(spec, DrafterContext(target=None, dtype=torch.float32, device=torch.device("cpu")))


def test_drafter_proposes_trees_roots_only_rows_and_feeds_the_global_cache():
    drafter = make_drafter(suffix_decoding_min_token_prob=0.0)
    # row 0: after (1, 2) came 3 and later 4: two distinct children; row 1: nothing repeats.
    batch = make_batch([[1, 2, 3, 9, 5, 1, 2, 4, 9, 6, 1, 2], [5, 6, 7]])
    drafter.prefill(batch, list(range(len(batch))))
    draft = drafter.propose(batch, 8)
    tree = draft.tree
    assert tree is not None and draft.q is None
    assert tree.tokens[0, 0] == 2 and tree.tokens[1, 0] == 7  # node 0 = newest committed token
    assert tree.valid[1].sum() == 1 and (tree.parents[1] == -1).all()  # no match: just the root
    kids = tree.children[0, 0][tree.children[0, 0] >= 0]
    assert sorted(tree.tokens[0, kids].tolist()) == [3, 4]
    assert int(tree.valid[0].sum()) - 1 <= drafter.max_draft_tokens(8)

    # Finish row 1 with output (8, 9, 10): it enters the global cache, then a new batch uses it.
    batch.seqs[1].token_ids += [8, 9, 10]
    batch.seqs[1].finish_reason = "length"
    drafter.on_verified(batch, torch.zeros(2, dtype=torch.long))
    assert list(drafter.cache.entries.values()) == [(8, 9, 10)]
    drafter.on_verified(batch, torch.zeros(2, dtype=torch.long))
    assert len(drafter.cache) == 1  # a finished row is cached once
    drafter.select_rows([])  # the batch is done: a new one joins
    batch2 = make_batch([[0, 8]])
    drafter.prefill(batch2, list(range(len(batch2))))
    assert drafter.propose(batch2, 8).tokens[0].tolist()[:1] == [9]
    assert drafter.stats.global_ == 1


def test_chains_come_out_as_chains():
    drafter = make_drafter()
    batch = make_batch([[1, 2, 3, 4, 1, 2], [7, 7]])
    drafter.prefill(batch, list(range(len(batch))))
    draft = drafter.propose(batch, 8)
    assert draft.tree is None
    assert draft.tokens[0].tolist()[:2] == [3, 4] and draft.num_tokens.tolist()[1] == 1


def test_options_validated():
    spec = parse_spec({"method": "suffix"})
    assert spec.num_speculative_tokens == SuffixDrafter.default_num_speculative_tokens
    assert spec.options.suffix_decoding_max_tree_depth == 24
    assert spec.options.suffix_decoding_max_cached_requests == 10000
    assert spec.options.suffix_decoding_max_spec_factor == 1.0
    assert spec.options.suffix_decoding_min_token_prob == 0.1
    bad = {
        "suffix_decoding_max_tree_depth": [1, 0, 2.5, True, 5000],
        "suffix_decoding_max_cached_requests": [-1, 1.0, None],
        "suffix_decoding_max_spec_factor": [0, -1.0, float("nan"), "2"],
        "suffix_decoding_min_token_prob": [-0.1, 1.5, float("inf")],
    }
    for key, values in bad.items():
        for value in values:
            with pytest.raises(SpecDecodeError, match=key) as err:
                parse_spec({"method": "suffix", key: value})
            assert "\n" not in str(err.value)
    with pytest.raises(SpecDecodeError, match="unknown key"):
        parse_spec({"method": "suffix", "suffix_decoding_max_depth": 8})
