"""n samples of one prompt: independent (their joint law is the product of their marginals)
and reproducible with a seed, with speculation."""

from __future__ import annotations

from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from specdecode import LLM, SamplingParams
from tests.engine.checks import SAMPLING_PROMPT, sampling_target


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = sampling_target(tmp_path_factory.mktemp("n") / "target")
    return LLM(model=str(path), speculative_config={"method": "ngram", "prompt_lookup_min": 1}, dtype="float32",
               device="cpu")  # fmt: skip


def test_samples_are_independent(llm):
    params = [SamplingParams(temperature=1.0, max_tokens=2, n=2, seed=s, ignore_eos=True) for s in range(1200)]
    outs = llm.generate([SAMPLING_PROMPT] * len(params), params)
    pairs = Counter((tuple(o.outputs[0].token_ids), tuple(o.outputs[1].token_ids)) for o in outs)
    firsts = sorted({a for a, _ in pairs})
    seconds = sorted({b for _, b in pairs})
    common_a = [a for a in firsts if sum(c for (x, _), c in pairs.items() if x == a) >= 40]
    common_b = [b for b in seconds if sum(c for (_, y), c in pairs.items() if y == b) >= 40]
    table = [[pairs[a, b] for b in common_b] for a in common_a]
    assert len(common_a) >= 2 and len(common_b) >= 2
    assert chi2_contingency(table).pvalue > 1e-3  # sample 1 does not depend on sample 0
    assert sum(o.outputs[0].token_ids != o.outputs[1].token_ids for o in outs) > len(outs) / 2


def test_samples_are_reproducible_and_the_first_is_the_seeds_own(llm):
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=42, ignore_eos=True)
    a, b = llm.generate([SAMPLING_PROMPT], params)[0], llm.generate([SAMPLING_PROMPT], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs] and len(a.outputs) == 3
    alone = llm.generate([SAMPLING_PROMPT], SamplingParams(temperature=1.0, max_tokens=6, seed=42, ignore_eos=True))[0]
    assert a.outputs[0].token_ids == alone.token_ids == a.token_ids
    assert [c.index for c in a.outputs] == [0, 1, 2]


def test_samples_share_the_prompts_prefill(tmp_path):
    """The n samples' prompt is computed once: the others find its full blocks cached."""
    llm = LLM(model=str(sampling_target(tmp_path / "target")), dtype="float32", device="cpu", speculative_config=None)
    prompt = (SAMPLING_PROMPT * 20)[:40]  # two full blocks of 16 and 8 tokens
    llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=1, ignore_eos=True))
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3 * 40, 2 * 32)
