"""The conformance suite: every method in the registry, in its default configuration and as
a tree where it drafts trees, gets these checks by being registered (tiny fp32 models):

- greedy output equals plain greedy output, each prompt alone and all together, with rounds cut
  by max_tokens;
- under continuous batching with joins, preemption and an abort, every finished request's
  output equals plain greedy alone, and no KV block is left held;
- a seeded sampled request gives the same tokens alone and beside other requests;
- with prefix caching, a multi-turn conversation and requests sharing a system prompt, at
  batch 1 and under continuous batching with preemption, give plain greedy's output without
  the cache, and a seeded sample is the same whether its prompt hit the cache or not;
- the sampled joint distribution of the first tokens is the target's (exact enumeration);
- with every sampling feature (penalties, logit_bias, min_p, min_tokens, stop_token_ids,
  allowed_token_ids, logprobs), alone and combined: greedy output and logprobs equal plain
  decoding's, and the sampled joint distribution is the processed target's;
- an unknown key in its configuration is one line naming the key.

A method whose options take the lookup keys (drafters/lookup.py) is also run with prompt lookup
beside it (variant "lookup"): greedy alone, together and under continuous batching, seeded
sampling alone and crowded, and the sampled joint distribution.

A method's own test file covers only what is special about it.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from specdecode import LLM, SamplingParams, StructuredOutput
from specdecode.drafters.registry import parse_spec
from specdecode.config import SpecDecodeError
from specdecode.drafters.lookup import LookupDrafter, LookupKeys
from specdecode.drafters.registry import drafter_class, method_names
from specdecode.engine.serving import ServingEngine
from tests.conformance.builders import BUILDERS, method_specs
from tests.engine.checks import (
    SAMPLING_PROMPT,
    SAMPLING_VOCAB,
    assert_greedy_matches_plain,
    assert_samples_follow_target,
    exact_joint,
    greedy,
    joint_chisquare,
    sampling_target,
    serve_all,
)
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]
# untied, 4 layers (dflash's block and layer_skip's exits need depth); seed 2 has no near-tie on
# these prompts' greedy paths
TARGET = {"arch": "llama", "seed": 2, "tie_word_embeddings": False, "num_hidden_layers": 4}


def cases() -> list[tuple[str, str]]:
    """(method, variant) for every registered method that has a builder."""
    out = []
    for method in method_names():
        variants = ["default", "tree"] if method in TREES else ["default"]
        out += [(method, v) for v in variants]
    return out


TREES = {"ngram", "layer_skip", "draft_model", "eagle", "eagle3", "mtp", "medusa"}
LOOKUP = {"prompt_lookup_max": 3, "num_speculative_tokens": 4, "num_steps": 1}  # copies 4 deep, own drafts 1


def lookup_cases() -> list[tuple[str, str]]:
    """(method, "lookup") for every registered method whose options take the lookup keys."""
    return [(m, "lookup") for m in method_names() if issubclass(drafter_class(m).Options, LookupKeys)]


def variant_spec(built: dict[str, dict], variant: str) -> dict:
    """A method's configuration for ``variant``: its builder's, or its default with prompt lookup."""
    return {**built["default"], **LOOKUP} if variant == "lookup" else built[variant]


def test_every_registered_method_has_a_builder():
    missing = sorted(set(method_names()) - set(BUILDERS))
    assert not missing, f"add a builder for {missing} to tests/conformance/builders.py"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    arch = TARGET["arch"]
    path = str(make_tiny_checkpoint(root / "target", arch, **{k: v for k, v in TARGET.items() if k != "arch"}))
    return root, path, LLM(model=path, dtype="float32", device="cpu", speculative_config=None)


@pytest.fixture(scope="module")
def specs(target):
    root, path, _ = target
    built: dict[str, dict[str, dict]] = {}

    def get(method: str, variant: str) -> dict:
        if method not in built:
            built[method] = method_specs(method, root / method, path)
        return variant_spec(built[method], variant)

    return get


@pytest.mark.parametrize("method,variant", cases() + lookup_cases())
def test_greedy_equals_plain(target, specs, method, variant):
    _, path, plain = target
    llm = LLM(model=path, speculative_config=specs(method, variant), dtype="float32", device="cpu")
    for max_tokens in (1, 2, 24):  # a round cut by max_tokens at once, after one token, and far in
        out = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, (method, variant))
    assert sum(o.metrics.num_drafts for o in out) > 0, "the drafter never proposed: nothing was verified"
    if variant == "lookup":  # the wrapper copied: drafts past the method's own one step were accepted
        assert isinstance(llm.engine.drafter, LookupDrafter)
        assert any(sum(o.metrics.accepted_per_position[1:]) > 0 for o in out), [o.metrics for o in out]


@pytest.mark.parametrize("method,variant", cases() + lookup_cases())
def test_serving_with_joins_preemption_and_aborts(target, specs, method, variant):
    """Six requests through a pool that holds about one sequence: rows join as others leave,
    the newest is preempted and recomputed; one request is aborted midway."""
    _, _, plain = target
    prompts = PROMPTS + [[4, 4, 4, 4], [9, 8, 7, 6, 5, 4, 3]]
    lengths = [20, 7, 33, 25, 12, 18]
    want = [plain.generate([p], greedy(n))[0].token_ids for p, n in zip(prompts, lengths)]
    spec = parse_spec(specs(method, variant))
    probe = ServingEngine(plain.target, spec, max_model_len=64, block_size=4)
    per_seq = -(-(64 + probe.round_room) // 4)
    engine = ServingEngine(plain.target, spec, max_model_len=64, max_num_seqs=6, block_size=4, num_blocks=per_seq + 2)
    outputs = serve_all(engine, prompts, [greedy(n) for n in lengths], abort_at=6)
    assert [o for i, o in enumerate(outputs) if i != 2] == [w for i, w in enumerate(want) if i != 2]
    assert engine.stats().num_preempted_total > 0
    assert engine.stats().kv_blocks_used == 0


SYSTEM = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]  # a shared system prompt: three blocks of 4 and one token


def run_requests(engine: ServingEngine, requests: dict[str, tuple[list[int], SamplingParams]],
                 accepted: dict[str, int] | None = None) -> dict[str, list[int]]:  # fmt: skip
    """Each request's output tokens; ``accepted`` gets each one's accepted draft tokens."""
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    for _ in range(2000):
        if not engine.has_unfinished():
            return out
        for e in engine.step():
            out[e.request_id] += e.new_token_ids
            if accepted is not None:
                accepted[e.request_id] = e.stats.num_accepted_tokens
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("method,variant", cases())
def test_prefix_caching_keeps_outputs(target, specs, method, variant):
    _, _, plain = target
    spec = parse_spec(specs(method, variant))
    reference = ServingEngine(plain.target, None, max_model_len=64, enable_prefix_caching=False)
    probe = ServingEngine(plain.target, spec, max_model_len=64, block_size=4)
    per_seq = -(-(64 + probe.round_room) // 4)
    engine = ServingEngine(plain.target, spec, max_model_len=64, max_num_seqs=4, block_size=4, num_blocks=per_seq + 2)
    uncached = ServingEngine(plain.target, spec, max_model_len=64, block_size=4, enable_prefix_caching=False)
    prompt, accepted, accepted_uncached = SYSTEM + [21], {}, {}
    for turn in range(3):  # batch 1: each turn's prompt is the last one, its answer and a new question
        got = run_requests(engine, {f"t{turn}": (prompt, greedy(8))}, accepted)[f"t{turn}"]
        assert got == run_requests(reference, {"r": (prompt, greedy(8))})["r"], (method, variant, turn)
        run_requests(uncached, {f"t{turn}": (prompt, greedy(8))}, accepted_uncached)
        prompt = prompt + got + [22 + turn]
    assert accepted == accepted_uncached, "a drafter drafted otherwise from a cached prompt (its features?)"
    hits = engine.stats().prefix_cache_hits
    assert hits >= 2 * len(SYSTEM) // 4 * 4, "later turns did not reuse the earlier ones"
    shared = {f"s{i}": (SYSTEM + [30 + i], greedy(24 + 6 * i)) for i in range(4)}  # batched, preempted
    got = run_requests(engine, shared)
    want = {rid: run_requests(reference, {rid: r})[rid] for rid, r in shared.items()}
    assert got == want, (method, variant)
    stats = engine.stats()
    assert stats.num_preempted_total > 0 and stats.prefix_cache_hits > hits and stats.kv_blocks_used == 0
    if not getattr(engine.drafter, "learns_from_other_requests", False):
        sampled = {"x": (SYSTEM + [40], SamplingParams(temperature=0.9, max_tokens=10, seed=5, ignore_eos=True))}
        before = engine.stats().prefix_cache_hits
        assert run_requests(engine, sampled) == run_requests(uncached, sampled)
        assert engine.stats().prefix_cache_hits > before


@pytest.mark.parametrize("method,variant", cases() + lookup_cases())
def test_seeded_sampling_alone_equals_crowded(target, specs, method, variant):
    _, _, plain = target
    spec = parse_spec(specs(method, variant))
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=7, ignore_eos=True)

    def run(others: int) -> list[int]:
        engine = ServingEngine(plain.target, spec, max_model_len=64, max_num_seqs=4)
        if getattr(engine.drafter, "learns_from_other_requests", False):
            pytest.skip("drafts from other requests' outputs: the sample depends on the traffic (README)")
        for i in range(others):
            other = SamplingParams(temperature=1.0, max_tokens=12, seed=i, ignore_eos=True)
            engine.add_request(f"o{i}", PROMPTS[i], other)
        engine.step()  # the others are decoding when it joins
        engine.add_request("x", PROMPTS[3], sampled)
        out: list[int] = []
        while engine.has_unfinished():
            out += [t for e in engine.step() if e.request_id == "x" for t in e.new_token_ids]
        return out

    alone = run(0)
    assert len(alone) == 16 and run(3) == alone


@pytest.mark.parametrize("method,variant", cases())
def test_an_unknown_key_is_one_line_naming_it(specs, method, variant):
    with pytest.raises(SpecDecodeError) as err:
        parse_spec({**specs(method, variant), "num_speculative_tokenz": 3})
    assert "num_speculative_tokenz" in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def sampling(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance_sampling")
    path = str(sampling_target(root / "target"))
    built: dict[str, dict[str, dict]] = {}

    def get(method: str, variant: str) -> tuple[str, dict]:
        if method not in built:
            built[method] = method_specs(method, root / method, path)
        return path, variant_spec(built[method], variant)

    return get


@pytest.mark.parametrize("method,variant", cases() + lookup_cases())
def test_sampled_joint_distribution_is_the_targets(sampling, method, variant):
    path, spec = sampling(method, variant)
    llm = LLM(model=path, speculative_config=spec, dtype="float32", device="cpu")
    assert_samples_follow_target(llm, 3, 0.9, 0, samples=2000)


# each alone, then all at once; the tiny target's vocabulary is 128 (EOS 2)
FEATURES = {
    "penalties": dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.5),
    "logit_bias": dict(logit_bias={3: 4.0, 82: -100.0, 29: 1.5}),
    "min_p": dict(min_p=0.2),
    "min_tokens": dict(min_tokens=20, stop_token_ids=[13, 22], ignore_eos=False),
    "allowed_token_ids": dict(allowed_token_ids=list(range(0, 128, 3))),
    "bad_words": dict(bad_words=["ab", "7", "x y"]),
    "logprobs": dict(logprobs=3),
    "processed_logprobs": dict(logprobs=2, logprobs_mode="processed_logprobs", repetition_penalty=1.2),
}
FEATURES["combined"] = {k: v for f in FEATURES.values() for k, v in f.items()} | {"stop_token_ids": [13]}
# structured outputs (the tiny tokenizer spells printable ASCII a character a token)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
          "b": {"enum": ["x", "yy", "zzz"]}}, "required": ["a", "b"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
FEATURES |= {
    "json_schema": dict(structured=StructuredOutput("json", SCHEMA), ignore_eos=False, max_tokens=40),
    "regex": dict(structured=StructuredOutput("regex", "[a-f]{2,8}( [0-9]{1,3}){2,6}"), logprobs=1),
    "choice": dict(structured=StructuredOutput("choice", ["alpha", "beta", "alphabet"]), ignore_eos=False),
}


@pytest.mark.parametrize("method,variant", cases())
def test_sampling_features_greedy_equal_plain(target, specs, method, variant):
    _, path, plain = target
    llm = LLM(model=path, speculative_config=specs(method, variant), dtype="float32", device="cpu")
    accepted = 0
    for name, feature in FEATURES.items():
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **feature})
        want = plain.generate(PROMPTS, params)
        if params.structured is not None and params.structured.kind != "regex":  # the grammar ended them
            assert all(o.finish_reason == "stop" for o in want), name
        got = llm.generate(PROMPTS, params)  # together (each alone: test_greedy_equals_plain)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids, (name, method, variant)
            if params.logprobs is not None:
                assert [x.token_id for x in g.logprobs] == g.token_ids
                for a, b in zip(g.logprobs, w.logprobs):
                    assert abs(a.logprob - b.logprob) <= 1e-5, (name, method, variant)
                    assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == params.logprobs
        accepted += sum(o.metrics.num_accepted_tokens for o in got)
        if name == "min_tokens":
            assert all(len(o.token_ids) >= 20 for o in want)  # held back, then free to stop
    assert accepted > 0


SAMPLED_FEATURES = dict(repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4,
                        logit_bias={2: 1.0, 4: -0.5}, min_p=0.1)  # fmt: skip


@pytest.mark.parametrize("method,variant", cases())
def test_sampled_features_follow_the_processed_target(sampling, method, variant):
    """Penalties, bias and min_p move p at every draft position by the draft tokens before it;
    the joint distribution of 3 tokens must still be plain decoding's, and the test must be
    able to tell it from the target's without the processing."""
    path, spec = sampling(method, variant)
    llm = LLM(model=path, speculative_config=spec, dtype="float32", device="cpu")
    base = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True, **SAMPLED_FEATURES)
    want = exact_joint(llm, SAMPLING_PROMPT, 3, 0, 0, params=base)
    params = [dataclasses.replace(base, seed=s) for s in range(1200)]
    outs = llm.generate([SAMPLING_PROMPT] * len(params), params)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    test = joint_chisquare([o.token_ids for o in outs], want, SAMPLING_VOCAB, 3)
    assert test.pvalue > 1e-3
    # power: penalties that miss the tokens before a position (as drafts left out of them would), or
    # no processing at all, would be told apart at this size
    for wrong in (exact_joint(llm, SAMPLING_PROMPT, 3, 0, 0, params=base, see_output=False),
                  exact_joint(llm, SAMPLING_PROMPT, 3, 0.9, 0)):  # fmt: skip
        assert test.pvalue_if(wrong) < 1e-3


@pytest.mark.parametrize("method,variant", cases())
def test_sampled_json_always_validates(target, specs, method, variant):
    _, path, _ = target
    llm = LLM(model=path, speculative_config=specs(method, variant), dtype="float32", device="cpu")
    base = SamplingParams(temperature=1.0, max_tokens=40, structured=StructuredOutput("json", SCHEMA))
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(200)],
                        [dataclasses.replace(base, seed=s) for s in range(200)])  # fmt: skip
    for o in outs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 20  # sampled, not one answer


@pytest.mark.parametrize("method,variant", cases())
def test_sampled_grammar_follows_the_masked_target(sampling, method, variant):
    """A regex over the sampling target's two text tokens ('0' and '1'; a '1' must be followed by
    a '0'): the mask at a draft position depends on the drafts before it."""
    path, spec = sampling(method, variant)
    llm = LLM(model=path, speculative_config=spec, dtype="float32", device="cpu")
    grammar = StructuredOutput("regex", "(0|10)+[01]{4}")
    base = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, structured=grammar)
    prompt = [4, 5, 4, 4, 5, 4, 4, 5, 4, 5, 4]  # "01001001010": drafts from it can pass the grammar
    want = exact_joint(llm, prompt, 3, 0, 0, params=base)
    outs = llm.generate([prompt] * 1000, [dataclasses.replace(base, seed=s) for s in range(1000)])
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    test = joint_chisquare([o.token_ids for o in outs], want, SAMPLING_VOCAB, 3)
    assert test.pvalue > 1e-3
    # power: the mask of the committed output alone (drafts left out of the grammar's state)
    assert test.pvalue_if(exact_joint(llm, prompt, 3, 0, 0, params=base, see_output=False)) < 1e-3
