"""The registry: every registered method parses from its name alone, and bad configurations
are one line naming what is valid."""

from __future__ import annotations

import dataclasses

import pytest

from specdecode.config import AutoSpec, SpecConfig, SpecDecodeError
from specdecode.drafters.registry import drafter_class, method_names, parse_spec


REQUIRED = {"draft_model": {"model": "/some/draft"}}  # keys a method cannot do without


@pytest.mark.parametrize("method", method_names())
def test_each_method_parses_from_its_name_with_its_own_options(method):
    spec = parse_spec({"method": method, **REQUIRED.get(method, {})})
    cls = drafter_class(method)
    assert isinstance(spec, SpecConfig) and spec.method == method
    assert isinstance(spec.options, cls.Options) and spec.num_speculative_tokens == cls.default_num_speculative_tokens
    assert parse_spec(spec.to_dict()) == spec  # a config round-trips through its dict


def test_auto_none_and_files(tmp_path):
    assert isinstance(parse_spec("auto"), AutoSpec) and parse_spec({"method": "auto", "model": "d"}) == AutoSpec("d")
    assert parse_spec(None) is None and parse_spec("none") is None and parse_spec("  ") is None
    path = tmp_path / "spec.json"
    path.write_text('{"method": "ngram", "num_speculative_tokens": 3}')
    assert parse_spec(f"@{path}") == parse_spec({"method": "ngram", "num_speculative_tokens": 3})
    path.write_text("none")
    assert parse_spec(f"@{path}") is None
    spec = parse_spec({"method": "ngram", "num_speculative_tokens": "auto"})
    assert spec.budget.adaptive and spec.num_speculative_tokens >= drafter_class("ngram").default_num_speculative_tokens


@pytest.mark.parametrize("value,says", [
    ({"method": "nope"}, "unknown speculative method 'nope'; valid: "),
    ({"num_speculative_tokens": 3}, 'needs a "method"'),
    ({"method": "ngram", "gamma": 2}, "unknown key(s) gamma"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, "),
    ({"method": "auto", "gamma": 2}, "unknown key(s) gamma for method 'auto'"),
    ({"method": "ngram", "num_speculative_tokens": "auto", "verify_budget": "fixed"}, "drop verify_budget"),
    ({"method": "draft_model"}, 'draft_model needs "model"'),
    ("{nope", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ("@/no/such/file.json", "cannot read the speculative config file"),
])  # fmt: skip
def test_bad_configurations_are_one_line(value, says):
    with pytest.raises(SpecDecodeError) as e:
        parse_spec(value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_hand_built_config_is_checked_as_its_dict():
    spec = parse_spec({"method": "ngram"})
    with pytest.raises(SpecDecodeError, match="Options dataclass"):
        parse_spec(dataclasses.replace(spec, options={"prompt_lookup_max": 3}))
    assert parse_spec(spec) == spec
