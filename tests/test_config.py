import pytest
import torch

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.drafters.registry import parse_spec


@pytest.mark.parametrize(
    "value,match",
    [
        ("{not json", "not valid JSON"),
        ('{"method": "banana"}', "unknown speculative method 'banana'; valid: dflash, draft_model, eagle"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"\[1, 32\]"),
        ('{"method": "ngram", "num_speculative_tokens": 33}', r"\[1, 32\]"),
        ('{"num_speculative_tokens": 3}', 'needs a "method"'),
        ('[1, 2]', "JSON object"),
        ('{"method": "draft_model"}', '"model"'),
    ],
)
def test_bad_spec_config(value, match):
    with pytest.raises(SpecDecodeError, match=match) as e:
        parse_spec(value)
    assert "\n" not in str(e.value)


def test_none_means_plain():
    assert parse_spec(None) is None
    assert parse_spec("") is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": 2**64}, "64-bit"),
        ({"seed": -(2**63) - 1}, "64-bit"),
        # True is an int in Python; here it never means a count, a seed or a temperature
        ({"seed": True}, "64-bit"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": True}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"temperature": 10**400}, "temperature"),  # an int too large for a float
        ({"top_k": -5}, "top_k"),  # -1 and 0 are off, as in vLLM
        ({"stop": 5}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"ignore_eos": "no"}, "ignore_eos"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(SpecDecodeError, match=match):
        SamplingParams(**kwargs)


def test_visible_text_holds_back_what_may_begin_a_stop_string():
    sp = SamplingParams(stop=("abc", "bd"))
    assert sp.visible_text("xxab", finished=False) == "xx"  # "ab" may become "abc"
    assert sp.visible_text("xxb", finished=False) == "xx"
    assert sp.visible_text("xxa\ufffd", finished=False) == "xx"  # an unfinished character, then "a"
    assert sp.visible_text("xxab", finished=True) == "xxab"
    assert sp.visible_text("xabcd", finished=False) == "x"
    # A long stop string: only tails as long as the text are tried (trying every prefix of the
    # stop would be quadratic in its length per streamed event; not timed here).
    long = SamplingParams(stop=("q" * 10_000 + "!",))
    assert long.visible_text("hello qq", finished=False) == "hello "
    assert long.visible_text("q" * 10, finished=False) == ""


def test_sampling_params_normalise_stop():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()  # vLLM's default value
    assert SamplingParams(top_k=2**63).top_k == 0  # past any vocabulary: off (was an overflow inside a step)
    assert SamplingParams(temperature=0).greedy


def test_tiny_temperatures_decode_greedily():
    """Below 1e-5 (vLLM's bound) logits / T would overflow to inf and the softmax to NaN."""
    from specdecode.core.sampling import logits_to_probs

    params = SamplingParams(temperature=1e-39)
    assert params.greedy and not SamplingParams(temperature=1e-4).greedy
    logits = torch.tensor([[[40.0, 41.0, 39.0]]])
    probs = logits_to_probs(logits, torch.tensor([params.temperature]), torch.tensor([0]), torch.tensor([1.0]))
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0]
