"""`specdecode tune`: successive halving keeps the fastest candidate (on injected speeds and
an injected clock), the command runs end to end on a tiny model and writes a configuration
that `--speculative-config @file` takes, and bad input is one line with exit code 2."""

from __future__ import annotations

import json
import types

import pytest

from specdecode.drafters.registry import parse_spec
from specdecode.entrypoints import tune
from specdecode.entrypoints.cli import main
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tune") / "target", "llama", seed=0))


class FakeLLM:
    """Decodes at a speed set per configuration; each call advances the fake clock by its time."""

    def __init__(self, clock, config=None, speeds=None):
        self.clock, self.config, self.speeds = clock, config, speeds
        self.spec = types.SimpleNamespace(to_dict=lambda: {"method": str(config)})

    def with_speculative_config(self, config):
        return FakeLLM(self.clock, config, self.speeds)


def fake_timed_generate(llm, ids, params, speculative):
    speed = llm.speeds[json.dumps(llm.config)] if speculative else 1.0  # tokens per second
    llm.clock.now += 10 / speed
    return [types.SimpleNamespace(token_ids=[0] * 10)], 10 / speed


def run_search(monkeypatch, speeds, time_limit):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(tune, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(tune, "timed_generate", fake_timed_generate)
    plain = FakeLLM(clock, speeds=speeds)
    configs = [json.loads(k) for k in speeds]
    return tune.search(plain, configs, [[1]] * 40, [None] * 40, time_limit)


def test_successive_halving_keeps_the_fastest(monkeypatch):
    speeds = {json.dumps(f"c{i}"): 1.0 + 0.1 * i for i in range(8)}  # c7 the fastest
    scores = run_search(monkeypatch, speeds, time_limit=1e9)
    assert [scores[f"c{i}"]["prompts"] for i in range(8)] == [2, 2, 2, 2, 6, 6, 14, 30]  # 2, +4, +8, +16
    assert scores["c7"]["speedup"] == pytest.approx(1.7) and scores["c7"]["rung"] == 3


def test_the_time_limit_stops_the_search(monkeypatch):
    speeds = {json.dumps(f"c{i}"): 2.0 for i in range(4)}
    scores = run_search(monkeypatch, speeds, time_limit=100.0)  # 15 s per prompt pair: 7 pairs
    assert sum(s["prompts"] for s in scores.values()) == 7


def test_tune_writes_a_configuration_generate_takes(tiny, tmp_path, capsys):
    out, ranking = tmp_path / "spec.json", tmp_path / "ranking.json"
    code = main(["tune", "--model", tiny, "--methods", "ngram", "--categories", "chat", "math", "--max-tokens", "8",
                 "--time-limit", "120", "--out", str(out), "--json", str(ranking), "--dtype", "float32"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "| rank |" in text and "best:" in text
    spec = parse_spec(f"@{out}")
    assert spec.method == "ngram"
    rows = json.loads(ranking.read_text())
    assert rows and {"label", "resolved", "speedup", "ci95", "prompts", "rung"} <= set(rows[0])
    assert rows[0]["resolved"] == spec.to_dict()
    assert main(["generate", "abcabc", "--model", tiny, "--max-tokens", "4", "--speculative-config", f"@{out}",
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["speculative_config"]["method"] == "ngram"


@pytest.mark.parametrize("argv,says", [
    (["--time-limit", "0"], "--time-limit must be a number of seconds > 0"),
    (["--time-limit", "-5"], "--time-limit must be a number of seconds > 0"),
    (["--methods", "ngram", "eagle9"], "unknown method 'eagle9' in the search space"),
    (["--categories", "poetry"], "unknown category 'poetry'"),
    (["--prompts", "/no/such/file.jsonl"], "cannot read --prompts"),
])  # fmt: skip
def test_bad_input_is_one_line(tiny, capsys, argv, says):
    code = main(["tune", "--model", tiny, *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and says in err and err.count("\n") == 1, err
