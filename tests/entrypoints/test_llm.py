"""The Python API: vLLM's shape, prompt forms, stop conditions and bad input as ValueError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecode import LLM, SamplingParams, SpecDecodeError
from specdecode.drafters.registry import parse_spec
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("api") / "m", "llama", seed=0)
    return LLM(model=str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 1}, dtype="float32", device="cpu")


def test_outputs_have_text_ids_and_metrics(llm):
    outs = llm.generate(["abcabc", [5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(outs) == 2
    for o in outs:
        assert len(o.token_ids) == 12 and isinstance(o.text, str)
        m = o.metrics
        # each round's 1 + accepted tokens, after the first (a last round cut by max_tokens has no bonus)
        assert m.num_drafts + m.num_accepted_tokens <= len(o.token_ids)
        assert m.num_accepted_tokens <= m.num_reached_tokens <= m.num_draft_tokens
        assert sum(m.accepted_per_position) == m.num_accepted_tokens
        assert m.wall_time_s > 0
    assert outs[0].text == llm.decode(outs[0].token_ids)


def test_single_prompt_forms(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    by_text = llm.generate("hello", params)[0]
    by_ids = llm.generate(llm.tokenize("hello"), params)[0]
    assert by_text.token_ids == by_ids.token_ids
    ids = llm.tokenize("hello")  # a tuple, a tensor, a numpy array or numpy ints are ids too (a tuple was refused)
    for given in (tuple(ids), torch.tensor(ids), np.array(ids), [np.int64(t) for t in ids]):
        outs = llm.generate(given, params)
        assert len(outs) == 1 and outs[0].token_ids == by_ids.token_ids, type(given)
    assert [o.token_ids for o in llm.generate(torch.tensor([ids, ids]), params)] == [by_ids.token_ids] * 2


def test_each_streamed_event_holds_the_stats_of_its_moment(llm):
    """Every event carried the same stats object, still counting: the first (the prefill's,
    before any round) said 10 drafts at the end."""
    events = list(llm.stream("abcabc", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    drafts = [e.stats.num_drafts for e in events]
    assert drafts[0] == 0 and drafts == sorted(drafts) and drafts[-1] > 0
    assert len({id(e.stats) for e in events}) == len(events)


def test_stop_string_cuts_text_and_tokens(llm):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)
    full = llm.generate("hello", params)[0]
    # a 2-character stop string whose first occurrence is well inside the text
    stop = next(full.text[i : i + 2] for i in range(3, len(full.text) - 2) if full.text.index(full.text[i : i + 2]) == i)
    cut = llm.generate("hello", SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 30


def test_chat_template(llm):
    ids = llm.encode_chat("hi")
    assert llm.decode(ids).endswith("<assistant>")


@pytest.mark.parametrize(
    "prompts,match",
    [
        ([], "non-empty"),
        ([""], "empty"),
        ([[1, 10_000]], "token ids"),
        ([3.5], "string or a list of token ids"),
    ],
)
def test_bad_prompts(llm, prompts, match):
    with pytest.raises(SpecDecodeError, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=2))


def test_a_second_call_while_a_stream_is_open_is_refused_and_the_stream_loses_nothing(llm):
    """The engines are shared: a generate call stepping them while a stream is open would take
    the stream's tokens (a KeyError there) and they were lost. It is refused in one line; the
    stream then finishes whole, and once it is closed the LLM takes calls again."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = llm.generate("abcabc", params)[0].token_ids
    stream = llm.stream("abcabc", params)
    got = list(next(stream).new_token_ids)
    with pytest.raises(SpecDecodeError, match="still open"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(SpecDecodeError, match="still open"):
        next(llm.stream("hello", SamplingParams(max_tokens=2)))
    got += [t for e in stream for t in e.new_token_ids]
    assert got == want
    half_read = llm.stream("abcabc", params)
    next(half_read)
    half_read.close()  # a consumer that stopped early
    assert llm.generate("abcabc", params)[0].token_ids == want
    assert llm.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("sampling_params", [[{"max_tokens": 3}], [None], "x", {"max_tokens": 3}])
def test_bad_sampling_params_are_one_line(llm, sampling_params):
    with pytest.raises(SpecDecodeError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate(["a"], sampling_params)


def test_text_that_is_not_utf8_and_bad_ids_to_decode_are_one_line(llm):
    with pytest.raises(SpecDecodeError, match="not valid UTF-8"):
        llm.generate("ab\udcff", SamplingParams(max_tokens=2))  # a non-UTF-8 byte in argv, as Python escapes it
    with pytest.raises(SpecDecodeError, match="not valid UTF-8"):
        llm.encode_chat("ab\udcff")
    with pytest.raises(SpecDecodeError, match="token ids to decode"):
        llm.decode([-1])
    import numpy as np
    import torch

    assert llm.decode(np.array([5, 6])) == llm.decode(torch.tensor([5, 6])) == llm.decode([5, 6])  # as HF's decode


def test_prompt_longer_than_context_is_a_value_error(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * llm.max_model_len], SamplingParams(max_tokens=2))


def test_generation_stops_at_context_end(llm):
    out = llm.generate([[5] * (llm.max_model_len - 3)], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_bad_config_fails_before_loading(tmp_path):
    with pytest.raises(SpecDecodeError, match="unknown speculative method 'eagle9'; valid: dflash, draft_model, eagle"):
        LLM(model=str(tmp_path / "missing"), speculative_config={"method": "eagle9"})
    with pytest.raises(SpecDecodeError, match="model path not found"):
        LLM(model=str(tmp_path / "missing"), speculative_config=None)
    with pytest.raises(SpecDecodeError, match="model must be a path"):
        LLM(model="", speculative_config=None)  # not the current folder
    for bad in ({"max_num_seqs": "4"}, {"max_model_len": 100.5}, {"num_blocks": 0}, {"max_num_seqs": True}):
        with pytest.raises(SpecDecodeError, match=f"{next(iter(bad))} must be an integer"):
            LLM(model=str(tmp_path / "missing"), **bad)  # checked before the model is looked for


def test_a_spec_config_built_by_hand_is_checked_as_its_dict_would_be(tmp_path):
    from specdecode.config import SpecConfig

    with pytest.raises(SpecDecodeError, match=r"num_speculative_tokens must be an integer in \[1, 32\]"):
        LLM(model=str(tmp_path / "missing"), speculative_config=SpecConfig("ngram", 100))
    assert parse_spec(SpecConfig("ngram", 4)).options.prompt_lookup_max == 5  # options=None: the defaults


def test_tree_budget_beyond_context(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", seed=0)
    spec = {"method": "ngram", "max_matches": 4, "num_draft_tokens": 200}
    with pytest.raises(SpecDecodeError, match="max_model_len=128 is too small for a round of up to 200 draft tokens; "
                                              "give max_model_len >= 203"):  # fmt: skip
        LLM(model=str(path), speculative_config=spec, dtype="float32", max_model_len=128)
    with pytest.raises(SpecDecodeError, match="give max_model_len >= 3"):  # said 'drafts up to 0 tokens'
        LLM(model=str(path), dtype="float32", max_model_len=2, speculative_config=None)


def test_default_quantization_keeps_a_gguf_quantized_and_a_dense_draft_follows(tmp_path):
    """The default ("auto") runs a GGUF on its own blocks where our CPU kernel can; a draft
    model given as an HF folder then loads dense (it has no GGUF blocks) instead of failing,
    and speculative greedy still equals plain greedy."""
    from specdecode.model.cpu_int4 import cpu_lib
    from tests.tiny import make_tiny_gguf

    path, _ = make_tiny_gguf(tmp_path / "t.gguf", "llama", quant="Q8_0")
    plain = LLM(model=str(path), device="cpu", speculative_config=None)
    assert plain.target.quantization == ("gguf" if cpu_lib() is not None else None)
    spec = {"method": "draft_model", "model": plain.target.path, "num_speculative_tokens": 3}  # its converted folder
    llm = LLM(model=str(path), device="cpu", speculative_config=spec, quantization="gguf")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = llm.generate([[1, 2, 3, 4]], params)[0]
    assert got.token_ids == llm.generate([[1, 2, 3, 4]], params, speculative=False)[0].token_ids
    assert got.metrics.num_accepted_tokens > 0


def test_acceptance_rate_is_the_per_token_alpha_the_formula_takes():
    """Rounds that stop at their first rejection, each draft accepted with probability 0.8 (the
    formula's model): α = accepted / reached recovers 0.8, and the formula's tokens per round at
    that α is the measured τ. accepted / drafted (vLLM's draft acceptance rate) is ~0.42 here."""
    import random

    from specdecode.entrypoints.outputs import RequestMetrics
    from specdecode.analysis.theory import expected_tokens_per_round

    rng, alpha, gamma = random.Random(0), 0.8, 8
    m = RequestMetrics()
    for _ in range(20000):
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        m.record(gamma, accepted)
    assert abs(m.acceptance_rate - alpha) < 0.01
    assert abs(expected_tokens_per_round(m.acceptance_rate, gamma) - m.mean_accepted_length) < 0.05
    assert abs(m.draft_acceptance_rate - alpha * (1 - alpha**gamma) / ((1 - alpha) * gamma)) < 0.01


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_call_whose_step_failed_leaves_the_llm_usable(llm, monkeypatch, error):
    """A drafter raising while the last row left the batch left a row no request owned: every
    later call failed. The LLM resets its engine after a failed step, and after Ctrl-C in one
    (which also left the call open for good: every later call was refused)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = llm.generate(["abcabc", "hello"], params)
    real, calls = llm.engine.drafter.select_rows, [0]

    def flaky(rows):
        calls[0] += 1
        if calls[0] == 2:
            raise error("drafter hiccup")
        return real(rows)

    monkeypatch.setattr(llm.engine.drafter, "select_rows", flaky)
    with pytest.raises(error, match="hiccup"):
        llm.generate(["abcabc", "hello"], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), params])
    got = llm.generate(["abcabc", "hello"], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.stats().kv_blocks_used == 0


def test_stop_strings_decode_the_output_once_a_step(llm, monkeypatch):
    """The output is decoded once a step, not once per stop string: a request with 10,000 of
    them would otherwise slow every step of every request."""
    tokenizer = llm.engine.tokenizer
    real, calls = tokenizer.decode, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", counting)
    stop = [f"never{i}" for i in range(50)]
    out = llm.generate("abcabc", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=stop))[0]
    assert len(out.token_ids) == 6 and calls[0] <= 8  # a step each (at most 6) and the output's text
