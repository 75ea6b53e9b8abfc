"""The suffix drafter end to end on tiny random models, in fp32.

(a) At temperature 0 it gives exactly plain greedy's tokens, at batch 1 and batch 4,
    over several `generate` calls in a row, so the global tree of earlier outputs is
    used (and, with a small cache, evicted from) while it stays lossless.
(b) Under sampling, the joint distribution of the first tokens equals the target's,
    with proposals drawn from both trees (multi-draft one-hot tree verification).
"""

from __future__ import annotations

import pytest

from specdecode import LLM, SamplingParams
from tests.engine.checks import (
    SAMPLING_VOCAB,
    assert_greedy_matches_plain,
    assert_target_distribution,
    exact_joint,
    greedy,
    joint_chisquare,
    sampling_target,
)
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("suffix") / "target", "llama", seed=0))


@pytest.fixture(scope="module")
def plain(target):
    return LLM(model=target, dtype="float32", device="cpu", speculative_config=None)


@pytest.mark.parametrize("options", [{}, {"num_speculative_tokens": 6, "suffix_decoding_max_cached_requests": 2,
                                          "suffix_decoding_max_tree_depth": 8, "suffix_decoding_min_token_prob": 0.0}])
def test_greedy_equals_plain_across_calls(target, plain, options):
    llm = LLM(model=target, speculative_config={"method": "suffix", **options}, dtype="float32", device="cpu")
    drafter = llm.engine.drafter
    for call, max_tokens in enumerate((40, 40, 17, 1, 33)):
        before = drafter.stats.global_
        batch = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, (options, call))
        if call == 1:  # the prompts repeat: earlier outputs are drafted from and accepted
            assert drafter.stats.global_ > before
            assert all(o.metrics.num_drafts > 0 for o in batch)
            assert min(o.metrics.acceptance_rate for o in batch) > 0.5
    assert 0 < len(drafter.cache) <= options.get("suffix_decoding_max_cached_requests", 10000)


def test_adaptive_budget_when_no_row_finds_a_suffix(tmp_path, virtual_clock):
    """A round in which no row's context has a match proposes a chain of width 0; the adaptive
    budget's shadow rounds read its rows (an IndexError on the first such round)."""
    path = str(make_tiny_checkpoint(tmp_path / "t", "llama", seed=2, tie_word_embeddings=False))  # varied, no near-ties
    spec = {"method": "suffix", "num_speculative_tokens": 6, "verify_budget": "adaptive"}
    llm = LLM(model=path, speculative_config=spec, dtype="float32", device="cpu")
    plain = LLM(model=path, dtype="float32", device="cpu", speculative_config=None)
    assert_greedy_matches_plain(llm, plain, [[5, 9, 3], *PROMPTS[1:]], 20, "suffix, adaptive")


def test_global_tree_drafts_a_repeated_prompt(target, plain):
    llm = LLM(model=target, speculative_config={"method": "suffix"}, dtype="float32", device="cpu")
    prompt = [40, 41, 42, 43]
    first = llm.generate([prompt], greedy(48))[0]
    second = llm.generate([prompt], greedy(48))[0]
    assert first.token_ids == second.token_ids == plain.generate([prompt], greedy(48))[0].token_ids
    # the second run drafts the first run's answer: fewer, fuller rounds
    assert second.metrics.num_accepted_tokens > first.metrics.num_accepted_tokens
    assert second.metrics.num_drafts < first.metrics.num_drafts or first.metrics.num_drafts == 0


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_sampled_joint_distribution_matches_target(tmp_path, temperature, top_k, top_p):
    V, n, samples = SAMPLING_VOCAB, 3, 3000
    target = sampling_target(tmp_path / "t")
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0,
            "suffix_decoding_max_spec_factor": 2.0}
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", device="cpu")
    drafter = llm.engine.drafter
    prompt = [1, 2, 3, 4, 1, 5, 1, 2, 0, 1]  # many earlier matches of the last tokens
    want = exact_joint(llm, prompt, n, temperature, top_k, top_p)

    def params(seeds):
        return [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=n, seed=s, ignore_eos=True)
                for s in seeds]  # fmt: skip

    llm.generate([prompt] * 200, params(range(10**6, 10**6 + 200)))  # fills the global tree
    assert len(drafter.cache) > 0
    global_before = drafter.stats.global_
    branching = []  # rounds whose draft had a node with several children
    propose = drafter.propose

    def counting_propose(batch, num_tokens):
        draft = propose(batch, num_tokens)
        branching.append(draft.tree is not None and max(draft.tree.fanout, default=0) > 1)
        return draft

    drafter.propose = counting_propose
    outs = llm.generate([prompt] * samples, params(range(samples)))
    assert any(branching)
    assert drafter.stats.global_ > global_before  # proposals came from earlier outputs too
    assert sum(o.metrics.num_drafts for o in outs) > 0
    test = joint_chisquare([o.token_ids for o in outs], want, V, n)
    assert_target_distribution(test, llm, prompt, n, temperature, top_k, want, top_p)
