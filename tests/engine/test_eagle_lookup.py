"""`eagle` with prompt lookup beside its net (``prompt_lookup_max``): rows whose suffix n-gram
occurred before draft its continuation, the others draft with the net, in the same round.
Greedy equals plain greedy (chains and trees, alone and batched, both kinds of row seen);
sampled output follows the target's exact joint distribution; an adaptive budget plans the
lookup rows on its own estimates; bad options get one line."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode import LLM
from specdecode.config import SpecConfig, SpecDecodeError
from specdecode.drafters.eagle_net import FeatureNet
from specdecode.model.loader import load_model
from tests.engine.checks import assert_greedy_matches_plain, assert_samples_follow_target, sampling_target
from tests.learned import trained_folder
from tests.tiny import make_tiny_checkpoint

PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 4, 4, 6], [11], [2, 3, 2, 3, 2, 3, 2, 3, 2]]
SHAPES = {"chain": {"num_steps": 1}, "tree": {"num_steps": 2, "topk": 3, "num_draft_tokens": 6}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_lookup")
    target = str(make_tiny_checkpoint(root / "target", "llama", seed=0))
    model = load_model(target, dtype=torch.float32, device="cpu").model
    net = str(trained_folder(FeatureNet, model, root / "eagle", draft_vocab=0))
    return target, net, LLM(model=target, dtype="float32", device="cpu")


def count_sources(drafter, monkeypatch) -> dict[str, int]:
    """Counts the rows each round gave to lookup and to the net, by wrapping the drafter's lookup."""
    seen = {"lookup": 0, "net": 0}
    look_up = drafter._look_up

    def spy(batch, num_tokens):
        found, matched = look_up(batch, num_tokens)
        seen["lookup"] += sum(1 for f in found if f)
        seen["net"] += sum(1 for f in found if not f)
        return found, matched

    monkeypatch.setattr(drafter, "_look_up", spy)
    return seen


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_plain(setup, monkeypatch, shape):
    target, net, plain = setup
    spec = {"method": "eagle", "model": net, "num_speculative_tokens": 4, "prompt_lookup_max": 3, **SHAPES[shape]}
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    seen = count_sources(llm.engine.drafter, monkeypatch)
    batch = []
    for max_tokens in (1, 17, 40):
        batch = assert_greedy_matches_plain(llm, plain, PROMPTS, max_tokens, shape)
    assert seen["lookup"] > 0 and seen["net"] > 0, seen
    # lookup drafts run deeper than the net's and are accepted there
    steps = SHAPES[shape]["num_steps"]
    assert any(len(o.metrics.accepted_per_position) > steps and o.metrics.accepted_per_position[steps] > 0
               for o in batch), [o.metrics.accepted_per_position for o in batch]  # fmt: skip


@pytest.mark.parametrize(
    "shape,prompt_lookup_min,temperature,top_k,top_p",
    [("chain", 1, 1.0, 0, 1.0), ("chain", 2, 0.8, 3, 1.0), ("tree", 2, 1.0, 0, 0.9)],
)
def test_sampled_joint_distribution_matches_target(tmp_path, monkeypatch, shape, prompt_lookup_min, temperature,
                                                   top_k, top_p):  # fmt: skip
    target = sampling_target(tmp_path / "t")
    model = load_model(str(target), dtype=torch.float32, device="cpu").model
    net = trained_folder(FeatureNet, model, tmp_path / "net", steps=20, draft_vocab=5)  # q = 0 on one token
    tree = {"topk": 2, "num_draft_tokens": 3} if shape == "tree" else {}
    spec = {"method": "eagle", "model": str(net), "num_speculative_tokens": 2, "num_steps": 1, "prompt_lookup_max": 2,
            "prompt_lookup_min": prompt_lookup_min, **tree}  # fmt: skip
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", device="cpu")
    seen = count_sources(llm.engine.drafter, monkeypatch)
    assert_samples_follow_target(llm, 3, temperature, top_k, top_p=top_p)
    # with V = 6 every row's last token occurred before: 1-grams give only lookup rows, 2-grams both
    assert seen["lookup"] > 0 and (prompt_lookup_min == 1 or seen["net"] > 0), seen


def test_an_adaptive_budget_plans_lookup_rows_on_its_own_estimates(setup, monkeypatch):
    """A lookup row has no draft probability to report: its confidences are NaN, which the
    budget replaces by its online estimates; greedy stays exact."""
    target, net, plain = setup
    spec = {"method": "eagle", "model": net, "num_speculative_tokens": 4, "num_steps": 2, "prompt_lookup_max": 3,
            "verify_budget": "adaptive"}  # fmt: skip
    llm = LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
    budget, plans, seen = llm.engine.budget, llm.engine.budget.acceptance.planned, []

    def spy(reqs, raw, evidence=None):
        seen.append(raw)
        return plans(reqs, raw, evidence)

    monkeypatch.setattr(budget.acceptance, "planned", spy)
    proposals, propose = [], llm.engine.drafter.propose

    def keep(batch, n):
        proposals.append(propose(batch, n))
        return proposals[-1]

    monkeypatch.setattr(llm.engine.drafter, "propose", keep)
    assert_greedy_matches_plain(llm, plain, PROMPTS, 24, "adaptive")
    nan_rows = [d for d in proposals if d.confidence is not None and bool(d.confidence.isnan().all(dim=1).any())]
    assert nan_rows, "some round should have had a lookup row"
    assert seen and all(not math.isnan(c) for raw in seen for row in raw for c in row)


@pytest.mark.parametrize(
    "extra,message",
    [({"prompt_lookup_min": 2}, "need prompt_lookup_max"), ({"num_steps": 1}, "need prompt_lookup_max"),
     ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min <= prompt_lookup_max"),
     ({"prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1"),
     ({"prompt_lookup_max": 3, "num_steps": 0}, "num_steps must be an integer >= 1"),
     ({"prompt_lookup_max": 3, "num_steps": "2"}, "num_steps must be an integer >= 1")],
)  # fmt: skip
def test_bad_options_get_one_line(extra, message):
    with pytest.raises(SpecDecodeError, match=message) as e:
        SpecConfig.parse({"method": "eagle", "num_speculative_tokens": 4, **extra})
    assert "\n" not in str(e.value)


def test_num_steps_past_gamma_gets_one_line(setup):
    target, net, _ = setup
    spec = {"method": "eagle", "model": net, "num_speculative_tokens": 2, "num_steps": 3, "prompt_lookup_max": 3}
    with pytest.raises(SpecDecodeError, match=r"num_steps \(3\) must be at most num_speculative_tokens \(2\)"):
        LLM(model=target, speculative_config=spec, dtype="float32", device="cpu")
