import pytest

from specdecode.config import SamplingParams, SpecConfig, SpecDecodeError


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
        SpecConfig.parse(value)
    assert "\n" not in str(e.value)


def test_none_means_plain():
    assert SpecConfig.parse(None) is None
    assert SpecConfig.parse("") is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(SpecDecodeError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_stop():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=0).greedy
