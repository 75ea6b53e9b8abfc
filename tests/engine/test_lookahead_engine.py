"""The lookahead drafter end to end on tiny random models, in fp32.

(a) The window rides in the verify pass: each window node's logits equal the target's
    logits for its contiguous run of positions run as a plain sequence.
(b) At temperature 0 it gives exactly plain greedy's tokens, at batch 1 and for a batch
    of prompts of different lengths, with and without pool seeding, and across EOS.
(c) The Jacobi window alone (no seeding) proposes n-grams that are accepted.
(d) Under sampling, the joint distribution of the first tokens equals the target's.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from tests.engine.checks import (
    assert_greedy_matches_plain,
    assert_samples_follow_target,
    greedy,
    sampling_target,
)
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]
JACOBI_ONLY = {"pool_from_prompt": False, "pool_from_output": False}
CONFIGS = {
    "default": {},
    "jacobi_only": {"lookahead_window": 3, "lookahead_ngram": 3, "lookahead_guess": 2, **JACOBI_ONLY},
    "wide": {"lookahead_window": 5, "lookahead_ngram": 5, "lookahead_guess": 4, "num_speculative_tokens": 3},
    "bigram": {"lookahead_window": 2, "lookahead_ngram": 2, "lookahead_guess": 1, "pool_from_prompt": False},
}


def lookahead(path: str, **options) -> LLM:
    return LLM(model=path, speculative_config={"method": "lookahead", **options}, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("lookahead") / "target", "llama", seed=0))


@pytest.fixture(scope="module")
def plain(target):
    return LLM(model=target, dtype="float32", device="cpu", speculative_config=None)


def test_window_logits_equal_plain_sequences(target):
    llm = lookahead(target, lookahead_window=3, lookahead_ngram=4, lookahead_guess=2)
    drafter, model = llm.engine.drafter, llm.target.model
    W, N = 3, 4
    seen = []  # (history at propose time, window tokens [B, A], aux logits [B, A, V]) per round
    propose, on_verified = drafter.propose, drafter.on_verified

    def spy_propose(batch, num_tokens):
        draft = propose(batch, num_tokens)
        seen.append([[list(s.token_ids) for s in batch.seqs], draft.aux.tokens.clone()])
        return draft

    def spy_on_verified(batch, num_accepted, aux_logits=None, hidden=None):
        seen[-1].append(aux_logits.clone())
        on_verified(batch, num_accepted, aux_logits, hidden)

    drafter.propose, drafter.on_verified = spy_propose, spy_on_verified
    llm.generate(PROMPTS[:2], greedy(12))
    assert len(seen) >= 3
    for history, window, logits in seen[:3]:
        for b, tokens in enumerate(history):
            for j in range(N - 1):
                for i in range(W):
                    level0 = window[b, :i + 1].tolist()
                    column = [int(window[b, jj * W + i]) for jj in range(1, j + 1)]
                    seq = torch.tensor([tokens + level0 + column])
                    cache = model.new_cache(1, seq.shape[1] + 1)
                    ref = model(seq, torch.arange(seq.shape[1])[None], cache)[0, -1]
                    torch.testing.assert_close(logits[b, j * W + i], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_plain(target, plain, name):
    llm = lookahead(target, **CONFIGS[name])
    for max_tokens in (1, 2, 17, 40):
        batch = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, name)
    assert sum(o.metrics.num_drafts for o in batch) > 0


def test_greedy_stops_at_eos_like_plain(plain, tmp_path):
    ref = plain.generate(PROMPTS, greedy(30))
    eos = ref[1].token_ids[7]  # a token plain greedy emits mid-way, so EOS lands inside a round
    path = str(make_tiny_checkpoint(tmp_path / "eos", "llama", seed=0, eos_token_id=eos))
    params = SamplingParams(temperature=0.0, max_tokens=30)
    want = LLM(model=path, dtype="float32", device="cpu", speculative_config=None).generate(PROMPTS, params)
    got = lookahead(path).generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert want[1].finish_reason == "stop"


def test_jacobi_window_alone_drafts_accepted_tokens(target, plain):
    # No pool seeding: every guess comes from the window's own n-grams. On a repetitive
    # prompt the tiny model settles into a loop that Jacobi iteration finds.
    llm = lookahead(target, **CONFIGS["jacobi_only"])
    prompt = [20, 21, 22, 23] * 6
    out = llm.generate([prompt], greedy(64))[0]
    assert out.token_ids == plain.generate([prompt], greedy(64))[0].token_ids
    assert llm.engine.drafter.stats.collected > 0
    assert out.metrics.num_accepted_tokens > 0 and out.metrics.acceptance_rate > 0


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_sampled_joint_distribution_matches_target(tmp_path, temperature, top_k, top_p):
    llm = lookahead(str(sampling_target(tmp_path / "t")), lookahead_window=2, lookahead_ngram=3, lookahead_guess=3)
    assert_samples_follow_target(llm, 3, temperature, top_k, top_p=top_p)
