"""``auto``, the default speculative configuration: parsing, the rule for each kind of model
(learned drafters shipped, none, a draft model given), and where it is the default."""

from __future__ import annotations

import json

import pytest

from specdecode import LLM
from specdecode.config import AutoSpec, SpecDecodeError
from specdecode.drafters.auto import resolve_auto
from specdecode.drafters.registry import parse_spec
from specdecode.entrypoints.cli import main
from specdecode.model.loader import load_model
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    target = make_tiny_checkpoint(root / "target", "llama", seed=0)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=5, num_hidden_layers=1)
    return str(target), str(draft)


def test_parsing(tmp_path):
    assert parse_spec("auto") == AutoSpec() == parse_spec({"method": "auto"})
    assert parse_spec("none") is None and parse_spec("None") is None and parse_spec(None) is None
    assert parse_spec({"method": "auto", "model": "/draft"}) == AutoSpec(model="/draft")
    with pytest.raises(SpecDecodeError, match="unknown key.s. gamma for method 'auto'"):
        parse_spec({"method": "auto", "gamma": 4})
    with pytest.raises(SpecDecodeError, match="auto's model must be a draft model folder"):
        parse_spec({"method": "auto", "model": 3})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    spec = parse_spec(f"@{path}")
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    path.write_text("auto")
    assert parse_spec(f"@{path}") == AutoSpec()
    with pytest.raises(SpecDecodeError, match="cannot read the speculative config file"):
        parse_spec(f"@{tmp_path / 'missing.json'}")


def test_a_model_without_drafters_gets_prompt_lookup(tiny):
    spec, why = resolve_auto(AutoSpec(), load_model(tiny[0], dtype="float32", device="cpu", progress=False))
    assert spec.method == "ngram" and spec.budget.adaptive and spec.options.datastore is None
    assert why.startswith("auto: ngram (prompt lookup: no learned drafter ships for this model")
    assert resolve_auto(AutoSpec(), load_model(tiny[0], dtype="float32", device="cpu", progress=False),
                        learned=True)[0].method == "ngram"  # nothing learned to choose, even where it would pay


def test_a_given_draft_model_is_used(tiny):
    spec, why = resolve_auto(AutoSpec(model=tiny[1]), load_model(tiny[0], dtype="float32", device="cpu", progress=False))
    assert spec.method == "draft_model" and spec.options.model == tiny[1] and spec.budget.adaptive
    assert "a draft model was given" in why


def test_the_default_model_gets_prompt_lookup_on_cpu_and_its_shipped_eagle_on_cuda():
    target = load_model(None, progress=False)
    spec, why = resolve_auto(AutoSpec(), target)  # a CPU target
    assert spec.method == "ngram" and spec.budget.adaptive and "costs more than it saves" in why
    spec, why = resolve_auto(AutoSpec(), target, learned=True)  # what a CUDA target gets
    assert spec.method == "eagle" and spec.budget.adaptive
    assert (spec.options.num_steps, spec.options.prompt_lookup_max, spec.options.datastore) == (1, 5, True)
    assert "EAGLE weights ship" in why and "shipped datastore" in why


def test_auto_is_the_default_of_the_api_and_the_cli(tiny, capsys):
    llm = LLM(model=tiny[0], dtype="float32", device="cpu")
    assert llm.spec.method == "ngram" and llm.auto_choice.startswith("auto: ngram")
    plain = LLM(model=tiny[0], dtype="float32", device="cpu", speculative_config="none")
    assert plain.spec is None and plain.auto_choice is None
    assert main(["generate", "abcabcabcabc", "--model", tiny[0], "--max-tokens", "8", "--dtype", "float32"]) == 0
    assert "auto: ngram" in capsys.readouterr().err
    assert main(["generate", "abcabc", "--model", tiny[0], "--max-tokens", "8", "--speculative-config", "none",
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["speculative_config"] is None and out["auto"] is None
