"""A request's admission checks and its per-request speculation override."""

from __future__ import annotations

import pytest

from specdecode.config import SamplingParams, SpecDecodeError
from specdecode.engine.requests import check_prompt, parse_override


@pytest.mark.parametrize("prompt,max_tokens,says", [
    ([], 4, "prompt is empty"),
    ([1, 99], 4, "prompt token ids must be integers in [0, 50)"),
    ([1, -1], 4, "prompt token ids must be integers"),
    (list(range(16)), 4, "prompt has 16 tokens but the context is 16"),
    (list(range(10)), 7, "max_tokens=7 is beyond the context: the prompt has 10 of 16 tokens, so at most 6"),
])  # fmt: skip
def test_a_prompt_the_engine_cannot_take_is_one_line(prompt, max_tokens, says):
    with pytest.raises(SpecDecodeError) as e:
        check_prompt(prompt, SamplingParams(max_tokens=max_tokens), vocab=50, max_model_len=16)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_prompt_that_fits_exactly_is_taken():
    check_prompt(list(range(10)), SamplingParams(max_tokens=6), vocab=50, max_model_len=16)


def test_the_override_chooses_gamma_within_the_engines():
    assert parse_override(None, 4) == 4
    assert parse_override({}, 4) == 4
    assert parse_override({"num_speculative_tokens": 0}, 4) == 0  # plain decoding for this request
    assert parse_override({"num_speculative_tokens": 2}, 4) == 2
    for bad, says in (({"num_speculative_tokens": 5}, "in [0, 4], got 5"), ({"method": "ngram"}, "takes only"),
                      ({"num_speculative_tokens": 1.5}, "got 1.5"), ([2], "takes only")):  # fmt: skip
        with pytest.raises(SpecDecodeError, match="num_speculative_tokens") as e:
            parse_override(bad, 4)
        assert says in str(e.value)
