"""benchmarks/load.py's `Recording` wraps an engine's budget policy: it must keep up with the
policy protocol (a method or argument the engine gained and it lacked broke bench_serving.py
on its first request, with no test to say so)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from specdecode.config import SamplingParams
from specdecode.drafters.registry import parse_spec
from specdecode.engine.serving import ServingEngine
from specdecode.model.loader import load_model
from tests.tiny import make_tiny_checkpoint


def _load():
    path = Path(__file__).parents[2] / "benchmarks" / "load.py"
    spec = importlib.util.spec_from_file_location("bench_load", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_load"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("budget", ["fixed", "adaptive"])
def test_recording_wraps_a_serving_engine_through_to_the_end(tmp_path, budget):
    target = load_model(str(make_tiny_checkpoint(tmp_path / "m", "llama", seed=0)), dtype="float32", device="cpu")
    spec = parse_spec({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                             "max_matches": 2, "verify_budget": budget})  # fmt: skip
    engine = ServingEngine(target, spec, max_model_len=64)
    engine.budget = recording = _load().Recording(engine.budget)
    for i, prompt in enumerate([[5, 6, 5, 6, 5, 6], [7, 8, 9, 7, 8]]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert recording.steps and len(recording.passes) == len(recording.steps)
    assert all(positions >= rows.rows for (positions, _), rows in zip(recording.passes, recording.steps))


def test_a_first_token_is_timed_when_the_prefill_made_it():
    """A request's first token comes out of the prefill; the same step's decode round then runs.
    Timed at the step's end, TTFT took that round in and the decode rate left it out."""
    import time
    from types import SimpleNamespace

    from specdecode.core.batch import SpecStats
    from specdecode.engine.requests import RequestEvent

    class Stub:  # one request: its first token, then a slow decode round in the same step
        budget = SimpleNamespace(steps=[], passes=[])
        pending: list[str] = []

        def add_request(self, rid, prompt, params):
            self.pending.append(rid)

        def has_unfinished(self):
            return bool(self.pending)

        def step(self):
            rid = self.pending.pop()
            first = RequestEvent(rid, [1], None, SpecStats(), 3, 1)
            time.sleep(0.05)  # the decode round
            return [first, RequestEvent(rid, [2, 3], "length", SpecStats(), 3, 3)]

    loop = _load().ClosedLoop(Stub(), [("chat", [1, 2, 3])], clients=1, num_requests=1, max_tokens=3)
    loop.advance()
    assert loop.done() and loop.first["r0"] <= loop.clock - 0.05
