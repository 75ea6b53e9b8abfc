"""The n-gram drafter needs no model: test its lookup directly."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdecode.config import SpecDecodeError
from specdecode.drafters.registry import parse_spec
from specdecode.drafters.ngram import NgramDrafter, NgramOptions, longest_match, lookup, lookup_rows


def arr(*xs):
    return np.array(xs, dtype=np.int64)


def test_longest_match_wins():
    # suffix [2, 3]: matches at 1 (followed by 9) ; suffix [1, 2, 3] matches at 0 (followed by 4)
    toks = arr(1, 2, 3, 4, 5, 7, 2, 3, 9, 1, 2, 3)
    assert lookup(toks, 1, 3, 2).tolist() == [4, 5]


def test_most_recent_match_among_equal_length():
    toks = arr(5, 6, 1, 5, 6, 2, 5, 6)
    assert lookup(toks, 2, 2, 1).tolist() == [2]


def test_no_match_and_min_length():
    toks = arr(1, 2, 3, 4)
    assert lookup(toks, 1, 3, 4).tolist() == []
    toks = arr(1, 2, 9, 2)
    assert lookup(toks, 2, 3, 4).tolist() == []  # only a 1-gram matches
    assert lookup(toks, 1, 3, 4).tolist() == [9, 2]


def test_lookup_rows_cuts_each_row_at_its_depth():
    """eagle's prompt lookup: per row the continuation within its own depth, and the matched n."""
    rows = [SimpleNamespace(token_ids=[1, 2, 3, 4, 5, 1, 2, 3]), SimpleNamespace(token_ids=[1, 2, 3, 4]),
            SimpleNamespace(token_ids=[7, 8, 7, 8])]  # fmt: skip
    chains, matched = lookup_rows(rows, 2, 3, [1, 4, 0])
    assert chains == [[4], [], []] and matched == [3, 0, 0]  # a depth of 0 drafts nothing, whatever matched


def test_a_draft_past_the_end_repeats_a_loop():
    """A continuation that runs into the end of the sequence goes on as an LZ77 copy where the
    match overlaps or adjoins the suffix it matched (period <= n: a loop), so a loop drafts all k tokens
    (vLLM's stops at the end: one period per round); a match further back is cut at the end."""
    assert lookup(arr(*[5] * 12), 2, 5, 4).tolist() == [5, 5, 5, 5]  # period 1
    loop = arr(9, 1, 2, 3, 1, 2, 3, 1, 2, 3)
    assert lookup(loop, 1, 3, 8).tolist() == [1, 2, 3, 1, 2, 3, 1, 2]  # period 3, n 3
    assert lookup(arr(1, 2, 3, 4, 1, 2), 2, 2, 4).tolist() == [3, 4, 1, 2]  # ends in time: as found
    assert lookup(arr(1, 2, 3, 4, 1, 2), 2, 2, 6).tolist() == [3, 4, 1, 2]  # period 4 > n 2: cut
    assert lookup(arr(7, 8, 7), 1, 1, 5).tolist() == [8, 7]  # period 2 > n 1: cut
    assert lookup(arr(1, 2, 3), 1, 2, 4).tolist() == []  # no match: nothing to repeat


def test_lookup_agrees_with_a_plain_search_on_random_sequences():
    """The backwards-growing match against the definition: for n from max down to min, the most
    recent earlier window equal to the last n tokens; its n is the proposal's evidence."""

    def plain(toks: list[int], lo: int, hi: int) -> tuple[int, int]:
        for n in range(min(hi, len(toks) - 1), lo - 1, -1):
            ends = [i + n for i in range(len(toks) - n) if toks[i : i + n] == toks[-n:]]
            if ends:
                return n, ends[-1]
        return 0, len(toks)

    rng = np.random.default_rng(0)
    for _ in range(3000):
        toks = rng.integers(0, int(rng.choice([2, 3, 6])), size=int(rng.integers(0, 30)))
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 7))
        assert longest_match(toks, lo, hi) == plain(toks.tolist(), lo, hi), (toks.tolist(), lo, hi)


def test_lookup_all_agrees_with_a_window_search_on_random_sequences():
    """lookup_all grows its matches backwards once; the reference compares windows per n (its
    earlier code), with the same continuations (loops repeated) and order."""
    from specdecode.drafters.ngram import continuation, lookup_all

    def plain(toks: np.ndarray, lo: int, hi: int, k: int, most: int) -> list[list[int]]:
        size, found = len(toks), []
        for n in range(min(hi, size - 1), lo - 1, -1):
            for hit in range(size - 1 - n, -1, -1):  # windows of toks[:-1], most recent first
                if (toks[hit : hit + n] == toks[size - n :]).all():
                    cont = continuation(toks, hit + n, k, n).tolist()
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) == most:
                            return found
        return found

    rng = np.random.default_rng(1)
    for _ in range(2000):
        toks = rng.integers(0, int(rng.choice([2, 3, 6])), size=int(rng.integers(0, 30)))
        lo = int(rng.integers(1, 4))
        hi, k, most = int(rng.integers(lo, 7)), int(rng.integers(1, 6)), int(rng.integers(1, 5))
        got = [c.tolist() for c in lookup_all(toks, lo, hi, k, most)]
        assert got == plain(toks, lo, hi, k, most), (toks.tolist(), lo, hi, k, most)


def test_a_proposal_carries_its_matched_length_as_evidence():
    class Rows(list):
        seqs = property(lambda self: self)

    spec = SimpleNamespace(options=NgramOptions(prompt_lookup_min=2, prompt_lookup_max=4))
    drafter = NgramDrafter(spec, SimpleNamespace(device=torch.device("cpu")))
    rows = Rows([SimpleNamespace(token_ids=t) for t in ([1, 2, 3, 4, 9, 2, 3, 4], [5, 6, 7, 5, 6], [1, 2, 3])])
    draft = drafter.propose(rows, 2)
    assert draft.tokens.tolist() == [[9, 2], [7, 5], [-1, -1]]
    assert draft.evidence == [3, 2, 0]


def test_options_validated():
    with pytest.raises(SpecDecodeError, match="prompt_lookup_min"):
        parse_spec({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(SpecDecodeError, match="unknown key"):
        parse_spec({"method": "ngram", "lookahead": 3})
    spec = parse_spec('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert spec.num_speculative_tokens == 3 and spec.options.prompt_lookup_max == 4
    # one bound alone: the other's default (2 or 5) moves to meet it, never past it (vLLM: equal)
    for given, want in [({}, (2, 5)), ({"prompt_lookup_max": 1}, (1, 1)), ({"prompt_lookup_min": 7}, (7, 7)),
                        ({"prompt_lookup_min": 1}, (1, 5)), ({"prompt_lookup_max": 9}, (2, 9))]:  # fmt: skip
        o = parse_spec({"method": "ngram", **given}).options
        assert (o.prompt_lookup_min, o.prompt_lookup_max) == want, given


def test_lookup_all_orders_longest_then_most_recent():
    from specdecode.drafters.ngram import lookup_all

    toks = arr(1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 6, 1, 2, 3)
    # suffix (1, 2, 3) matched at 0 -> [4, 9]; then (2, 3) most recent first: [6, 1], [5, 7], then 3-grams done
    found = [c.tolist() for c in lookup_all(toks, 2, 3, 2, 4)]
    assert found == [[4, 9], [6, 1], [5, 7]]
    assert [c.tolist() for c in lookup_all(toks, 2, 3, 2, 1)] == [[4, 9]]


def test_merge_into_tree_shares_prefixes_and_respects_budget():
    from specdecode.drafters.ngram import merge_into_tree

    chains = [arr(5, 6, 7), arr(5, 8), arr(9)]
    tokens, parents = merge_into_tree(chains, budget=10)
    assert tokens == [5, 6, 7, 8, 9] and parents == [0, 1, 2, 1, 0]
    tokens, parents = merge_into_tree(chains, budget=4)
    assert tokens == [5, 6, 7, 8] and parents == [0, 1, 2, 1]


def test_tree_options_validated():
    with pytest.raises(SpecDecodeError, match="node budget"):
        parse_spec({"method": "ngram", "max_matches": 3, "num_draft_tokens": 0})
    with pytest.raises(SpecDecodeError, match="max_matches"):
        parse_spec({"method": "ngram", "max_matches": 0})
    with pytest.raises(SpecDecodeError, match="it needs max_matches > 1"):  # a chain ignored it quietly
        parse_spec({"method": "ngram", "num_draft_tokens": 12})
