"""`layer_skip` (early exit): exact greedy, the target's sampled distribution, shared
weights, and one-line errors."""

from __future__ import annotations

import pytest

from specdecode import LLM
from specdecode.config import SpecDecodeError
from tests.engine.checks import assert_greedy_matches_plain, assert_samples_follow_target, sampling_target
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("shape", [{}, {"exit_layer": 2, "topk": 2}])
def test_greedy_equals_plain(tmp_path, arch, shape):
    path = str(make_tiny_checkpoint(tmp_path / arch, arch, seed=0))
    plain = LLM(model=path, dtype="float32", device="cpu", speculative_config=None)
    spec = {"method": "layer_skip", "num_speculative_tokens": 3, **shape}
    llm = LLM(model=path, speculative_config=spec, dtype="float32", device="cpu")
    out = assert_greedy_matches_plain(llm, plain, PROMPTS, 25, (arch, shape))
    assert sum(o.metrics.num_accepted_tokens for o in out) > 0
    draft = llm.engine.drafter.model
    assert draft.layers[0] is llm.target.model.layers[0] and len(draft.layers) == shape.get("exit_layer", 1)


@pytest.mark.parametrize("shape,temperature,top_p", [({}, 1.0, 1.0), ({"topk": 2}, 0.9, 0.9)])
def test_sampled_joint_distribution_matches_target(tmp_path, shape, temperature, top_p):
    spec = {"method": "layer_skip", "num_speculative_tokens": 2, **shape}
    llm = LLM(model=str(sampling_target(tmp_path / "t")), speculative_config=spec, dtype="float32", device="cpu")
    assert_samples_follow_target(llm, 3, temperature, 0, top_p=top_p)


@pytest.mark.parametrize(
    "spec,words",
    [({"exit_layer": 3}, "below the target's 3 layers"), ({"exit_layer": 0}, "exit_layer must be"),
     ({"model": "x"}, "takes no \"model\""), ({"topk": 0}, "topk must be"),
     ({"speculative_token_tree": [[0], [0, 200]]}, "rank 200, the vocabulary has")],  # one line, not a crash
)
def test_bad_options_get_one_line(tmp_path, spec, words):
    path = str(make_tiny_checkpoint(tmp_path / "t", "llama", seed=0))
    with pytest.raises(SpecDecodeError, match=words):
        LLM(model=path, speculative_config={"method": "layer_skip", **spec}, dtype="float32", device="cpu")
