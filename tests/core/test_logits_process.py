"""Logit processing against Hugging Face transformers' processors (the reference) and the
OpenAI / vLLM formulas: penalties, bias, token masks, min_p; a draft prefix counts as output."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from specdecode import SamplingParams
from specdecode.config import SpecDecodeError
from specdecode.core.logits_process import RowState, bad_words_ids, process_logits
from specdecode.core.sampling import logits_to_probs, sampling_tensors

V = 50
PROMPT = [1, 4, 4, 9]
OUTPUT = [7, 7, 3, 12]


def logits(n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def process(x: torch.Tensor, params: SamplingParams, prefix=(), output=OUTPUT, eos=(2,), bad=None) -> torch.Tensor:
    st = RowState(PROMPT, output, params, eos, bad)
    return process_logits(x, [0] * len(x), [list(prefix)] * len(x), [st])


def test_repetition_penalty_is_hf_over_prompt_and_output():
    x = logits()
    sp = SamplingParams(repetition_penalty=1.7)
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([PROMPT + OUTPUT]), x.clone())
    torch.testing.assert_close(process(x, sp), want)


def test_presence_and_frequency_penalties_are_openais_formula_over_the_output():
    x = logits()
    sp = SamplingParams(presence_penalty=0.8, frequency_penalty=-0.3)
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=V).float()
    want = x - 0.3 * -counts - 0.8 * (counts > 0).float()  # the prompt is not counted (vLLM, OpenAI)
    torch.testing.assert_close(process(x, sp), want)


def test_a_draft_prefix_counts_as_output():
    x = logits(3, seed=1)
    sp = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7, min_tokens=6,
                        stop_token_ids=[5])  # fmt: skip
    for prefix in ([], [8], [8, 8, 30]):
        torch.testing.assert_close(process(x, sp, prefix), process(x, sp, (), OUTPUT + prefix))
    assert process(x, sp, [8])[0, 5] == float("-inf") and process(x, sp, [8, 8])[0, 5] > float("-inf")


def test_min_tokens_holds_eos_and_stop_ids_back_as_hf():
    x = logits()
    sp = SamplingParams(min_tokens=6, max_tokens=10, stop_token_ids=[11])
    hf = MinNewTokensLengthLogitsProcessor(len(PROMPT), 6, [2, 11])
    want = hf(torch.tensor([PROMPT + OUTPUT]), x.clone())
    torch.testing.assert_close(process(x, sp), want)
    assert torch.equal(process(x, sp, [0, 0]), x)  # six tokens out: free to stop
    ignored = SamplingParams(min_tokens=6, max_tokens=10, ignore_eos=True)
    assert process(x, ignored)[0, 2] == x[0, 2]  # EOS does not stop such a request: not held back either


def test_logit_bias_and_allowed_token_ids():
    x = logits()
    out = process(x, SamplingParams(logit_bias={3: 5.0, "7": -100}))
    want = x.clone()
    want[0, 3] += 5
    want[0, 7] -= 100
    torch.testing.assert_close(out, want)
    allowed = process(x, SamplingParams(allowed_token_ids=[4, 9, 49]))
    assert torch.isfinite(allowed[0]).nonzero()[:, 0].tolist() == [4, 9, 49]
    torch.testing.assert_close(allowed[0, [4, 9, 49]], x[0, [4, 9, 49]])


def test_bad_words_are_hfs_no_bad_words_over_the_output():
    x = logits()
    bad = [[12, 30], [3], [7, 3, 44]]
    sp = SamplingParams(bad_words=["unused"])
    hf = NoBadWordsLogitsProcessor(bad, eos_token_id=2)
    for output in (OUTPUT, OUTPUT[:-1], OUTPUT + [30]):
        want = hf(torch.tensor([output]), x.clone())
        torch.testing.assert_close(process(x, sp, (), output, bad=bad), want)


def test_bad_words_ids_take_both_spellings():
    class Tok:
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            return {"input_ids": [ord(c) for c in text]}

    assert bad_words_ids(SamplingParams(bad_words=["ab"]), Tok()) == [[97, 98], [32, 97, 98]]


@pytest.mark.parametrize("temperature", [0.5, 1.3])
def test_min_p_is_hfs_after_temperature(temperature):
    x = logits(2, seed=3)[None]  # [1, 2, V]
    sp = SamplingParams(temperature=temperature, min_p=0.15)
    got = logits_to_probs(x, *sampling_tensors([sp], "cpu"))[0]
    scores = MinPLogitsWarper(0.15)(None, TemperatureLogitsWarper(temperature)(None, x[0].clone()))
    torch.testing.assert_close(got, torch.softmax(scores, dim=-1))
    greedy = logits_to_probs(x, *sampling_tensors([SamplingParams(temperature=0, min_p=0.9)], "cpu"))[0]
    assert torch.equal(greedy.argmax(-1), x[0].argmax(-1))  # min_p never moves the argmax


def test_untouched_rows_and_settings_that_process_nothing():
    x = logits(2)
    assert not SamplingParams(min_p=0.5, stop_token_ids=[3], logprobs=2).processes_logits
    st = RowState(PROMPT, OUTPUT, SamplingParams(presence_penalty=1.0), (2,))
    out = process_logits(x, [0, 1], [[], []], [None, st])
    assert torch.equal(out[0], x[0]) and not torch.equal(out[1], x[1])


@pytest.mark.parametrize(
    "kwargs,field",
    [(dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
     (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
     (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
     (dict(logit_bias=[1, 2]), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
     (dict(min_tokens=20, max_tokens=5), "min_tokens"), (dict(stop_token_ids=["a"]), "stop_token_ids"),
     (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(bad_words=[""]), "bad_words"),
     (dict(logprobs=True), "logprobs"), (dict(logprobs_mode="raw"), "logprobs_mode"), (dict(n=0), "n")],
)  # fmt: skip
def test_bad_settings_are_one_line_naming_the_field(kwargs, field):
    with pytest.raises(SpecDecodeError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_n_samples_have_distinct_reproducible_seeds():
    sp = SamplingParams(n=4, seed=11)
    seeds = [sp.sample_seed(i) for i in range(4)]
    assert seeds[0] == 11 and len(set(seeds)) == 4 and seeds == [sp.sample_seed(i) for i in range(4)]
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert SamplingParams(n=3).sample_seed(2) is None
