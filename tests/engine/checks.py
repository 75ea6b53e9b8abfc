"""Shared end-to-end checks: greedy speculative output against plain greedy, the target's
exact joint distribution of the first n tokens (by enumeration on a tiny vocabulary), and
a pooled chi-square test of sampled continuations against it, with its power."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from scipy.stats import chisquare

from specdecode import LLM, SamplingParams
from specdecode.core.logits_process import RowState, process_logits
from specdecode.core.sampling import logits_to_probs, sampling_tensors
from specdecode.core.structured import Grammar
from tests.tiny import make_tiny_checkpoint


def exact_joint(
    llm: LLM, prompt: list[int], n: int, temperature: float, top_k: int, top_p: float = 1.0,
    params: SamplingParams | None = None, see_output: bool = True,
) -> dict[tuple, float]:  # fmt: skip
    """The target's probability of every n-token continuation of ``prompt`` (tiny vocab), as
    plain decoding would sample it; with ``params``, under all of its settings (penalties,
    bias, masks, min_p: logits_process.py) in place of the three given. ``see_output`` False
    is a wrong rule for power checks: penalties that never see the tokens generated so far."""
    model = llm.target.model
    V = llm.target.config.vocab_size
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        prefixes = list(probs)
        tokens = torch.tensor([prompt + list(pre) for pre in prefixes])
        cache = model.new_cache(len(prefixes), tokens.shape[1] + 1)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions, cache)[:, -1:]
        B = len(prefixes)
        if params is None:
            p = logits_to_probs(logits, torch.full((B,), temperature), torch.full((B,), top_k), torch.full((B,), top_p))
        else:
            grammar = None
            if params.structured is not None:
                grammar = Grammar(params.structured, llm.tokenizer, V, llm.target.config.eos_token_ids)
            state = RowState(prompt, [], params, llm.target.config.eos_token_ids, grammar=grammar)
            seen = prefixes if see_output else [()] * B
            logits = process_logits(logits[:, 0], range(B), seen, [state] * B)[:, None]
            p = logits_to_probs(logits, *sampling_tensors([params] * B, "cpu"))
        p = p[:, 0]
        probs = {pre + (t,): probs[pre] * float(p[i, t]) for i, pre in enumerate(prefixes) for t in range(V)}
    return probs


@dataclass
class JointChiSquare:
    """Observed continuations against ``want``, rare cells pooled (expected count >= 5 per cell)."""

    common: list[tuple]
    expected: list[float]
    samples: int
    pvalue: float

    def pvalue_if(self, dist: dict[tuple, float]) -> float:
        """The p-value the same test would give had the samples followed ``dist`` exactly (power)."""
        alt = [dist.get(k, 0) * self.samples for k in self.common]
        alt.append(self.samples - sum(alt))
        return float(chisquare(alt, self.expected).pvalue)


def joint_chisquare(continuations: list[list[int]], want: dict[tuple, float], vocab: int, n: int) -> JointChiSquare:
    samples = len(continuations)
    counts: dict[tuple, int] = {}
    for c in continuations:
        counts[tuple(c)] = counts.get(tuple(c), 0) + 1
    keys = [k for k in itertools.product(range(vocab), repeat=n) if want[k] > 0]
    assert set(counts) <= set(keys), "sampled a continuation the target gives probability 0"
    common = sorted((k for k in keys if want[k] * samples >= 5), key=lambda k: -want[k])
    # the pooled rest needs an expected count >= 5 too: where it has (nearly) nothing, round-off left it
    # slightly negative and the power check's statistic NaN; the rarest common cells join it
    while common and samples * (1 - sum(want[k] for k in common)) < 5:
        common.pop()
    obs = [counts.get(k, 0) for k in common] + [samples - sum(counts.get(k, 0) for k in common)]
    exp = [want[k] * samples for k in common] + [samples * (1 - sum(want[k] for k in common))]
    return JointChiSquare(common, exp, samples, float(chisquare(obs, exp).pvalue))


def greedy(max_tokens: int) -> SamplingParams:
    """Temperature 0 for exactly ``max_tokens`` tokens (EOS does not stop it)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def assert_target_distribution(test: JointChiSquare, llm: LLM, prompt: list[int], n: int, temperature: float,
                               top_k: int, want: dict[tuple, float], top_p: float = 1.0) -> None:  # fmt: skip
    """The samples pass the test, and the test has power: a sampler slightly off (the target
    at 0.8x the temperature, or one that puts 10% of its mass uniformly over the
    continuations the target allows) would be rejected at the same size."""
    assert test.pvalue > 1e-3
    colder = exact_joint(llm, prompt, n, 0.8 * temperature, top_k, top_p)
    allowed = [k for k, v in want.items() if v > 0]
    for wrong in (colder, {k: 0.9 * want[k] + 0.1 / len(allowed) for k in allowed}):
        assert test.pvalue_if(wrong) < 1e-3


SAMPLING_PROMPT = [1, 2, 3, 4, 1, 5, 1, 2, 0, 1]  # for V = 6: repeats, so every drafter finds something
SAMPLING_VOCAB = 6
# The sampled tests' target has its logits scaled down: at scale 1 one continuation of
# SAMPLING_PROMPT had 92% of the mass, drafts were nearly always accepted, and a biased rule
# (accepting with min(1, 1.1 p/q), a residual p - 0.9 q, a q that ignores top-k) passed.
# At 0.3 the likeliest of 216 continuations has ~25% (46% at T = 0.7, top-k 4).
SAMPLING_LOGIT_SCALE = 0.3


def sampling_target(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """The sampled tests' tiny llama target (V = 6, spread next-token distributions) at ``path``."""
    return make_tiny_checkpoint(path, "llama", seed, SAMPLING_LOGIT_SCALE, vocab_size=SAMPLING_VOCAB, **overrides)


def assert_samples_follow_target(llm: LLM, n: int, temperature: float, top_k: int, samples: int = 3000,
                                 prompt: list[int] = SAMPLING_PROMPT, top_p: float = 1.0) -> list:  # fmt: skip
    """Sample ``samples`` continuations of n tokens (seeds 0..samples-1); some drafts must be
    accepted, and the joint distribution must pass the chi-square test with its power check.
    Returns the outputs."""
    V = llm.target.config.vocab_size
    want = exact_joint(llm, prompt, n, temperature, top_k, top_p)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=n, seed=s, ignore_eos=True)
              for s in range(samples)]  # fmt: skip
    outs = llm.generate([prompt] * samples, params)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    test = joint_chisquare([o.token_ids for o in outs], want, V, n)
    assert_target_distribution(test, llm, prompt, n, temperature, top_k, want, top_p)
    return outs


def assert_greedy_matches_plain(llm: LLM, plain: LLM, prompts: list[list[int]], max_tokens: int, label: object) -> list:
    """Each prompt alone and all together give exactly plain greedy's tokens; returns the batch outputs."""
    params = greedy(max_tokens)
    ref = plain.generate(prompts, params)
    single = [llm.generate([p], params)[0] for p in prompts]
    batch = llm.generate(prompts, params)
    for r, s, b in zip(ref, single, batch):
        assert len(r.token_ids) == max_tokens
        assert s.token_ids == r.token_ids, (label, max_tokens)
        assert b.token_ids == r.token_ids, (label, max_tokens)
    engine = llm.engine  # under a fixed budget (the adaptive one may, by its timing, verify nothing)
    if max_tokens >= 17 and engine.drafter is not None and not engine.spec.budget.adaptive:
        # else the two could be equal with the accept path never run
        assert sum(o.metrics.num_accepted_tokens for o in batch) > 0, (label, "no draft was ever accepted")
    return batch


def serve_all(engine, prompts: list[list[int]], params: list[SamplingParams], abort_at: int | None = None,
              accepted: list[int] | None = None) -> list[list[int]]:  # fmt: skip
    """Run ``prompts`` through a `ServingEngine` together; each one's output tokens, in order.
    ``abort_at``: request "2" is aborted after that many steps; ``accepted`` gets each finished
    request's accepted draft tokens."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp)
    steps = 0
    while engine.has_unfinished():
        for e in engine.step():
            outputs[int(e.request_id)] += e.new_token_ids
            if e.finish_reason is not None and accepted is not None:
                accepted.append(e.stats.num_accepted_tokens)
        steps += 1
        if steps == abort_at:
            engine.abort("2")
        assert steps < 2000
    return outputs
