"""benchmarks/load.py's `Recording` wraps an engine's budget policy: it must keep up with the
policy protocol (a method or argument the engine gained and it lacked broke bench_serving.py
on its first request, with no test to say so)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine.serving import ServingEngine
from specdecode.model.loader import load_model
from tests.tiny import make_tiny_checkpoint


def _load():
    path = Path(__file__).parents[1] / "benchmarks" / "load.py"
    spec = importlib.util.spec_from_file_location("bench_load", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_load"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("budget", ["fixed", "adaptive"])
def test_recording_wraps_a_serving_engine_through_to_the_end(tmp_path, budget):
    target = load_model(str(make_tiny_checkpoint(tmp_path / "m", "llama", seed=0)), dtype="float32", device="cpu")
    spec = SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                             "max_matches": 2, "verify_budget": budget})  # fmt: skip
    engine = ServingEngine(target, spec, max_model_len=64)
    engine.budget = recording = _load().Recording(engine.budget)
    for i, prompt in enumerate([[5, 6, 5, 6, 5, 6], [7, 8, 9, 7, 8]]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert recording.steps and len(recording.passes) == len(recording.steps)
    assert all(positions >= rows.rows for (positions, _), rows in zip(recording.passes, recording.steps))
