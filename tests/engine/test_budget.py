"""Verification budgets: cutting proposals to per-row budgets, the fixed policy, the budget keys
of ``speculative_config``, the verify-cost curve and STS."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import SpecDecodeError
from specdecode.drafters.registry import parse_spec
from specdecode.drafters.base import Draft
from specdecode.engine.budget import FixedBudget, apply_budgets
from specdecode.core.tree import TreeBatch
from tests.engine.test_adaptive import req


def test_chain_budgets_truncate_rows():
    draft = Draft(tokens=torch.tensor([[1, 2, 3], [4, 5, -1], [6, 7, 8]]))
    cut = apply_budgets(draft, torch.tensor([3, 1, 0]))
    assert cut.tokens.tolist() == [[1, 2, 3], [4, -1, -1], [-1, -1, -1]]
    assert cut.num_tokens.tolist() == [3, 1, 0]


def test_tree_budgets_drop_deeper_nodes():
    # root -> a -> c, root -> b; budget 1 keeps a and b, budget 0 only the root
    tree = TreeBatch.from_parents(torch.tensor([[9, 1, 2, 3]] * 2), torch.tensor([[-1, 0, 0, 1]] * 2))
    cut = apply_budgets(Draft.from_tree(tree), torch.tensor([1, 0])).tree
    assert cut.valid.tolist() == [[True, True, True, False], [True, False, False, False]]
    assert cut.max_depth == 1


def test_fixed_budget_cap_splits_evenly():
    assert FixedBudget().budgets([req("a")] * 3, torch.tensor([4, 2, 4]), None).tolist() == [4, 2, 4]
    assert FixedBudget(max_verify_tokens=9).budgets([req("a")] * 3, torch.tensor([4, 2, 4]), None).tolist() == [2, 2, 2]


@pytest.mark.parametrize(
    "config,match",
    [
        ({"method": "ngram", "verify_budget": "sometimes"}, "verify_budget"),
        ({"method": "ngram", "max_verify_tokens": 0}, "max_verify_tokens"),
        ({"method": "ngram", "budget": "adaptive"}, "verify_budget, max_verify_tokens, throughput_floor"),
        ({"method": "ngram", "verify_budget": "adaptive", "throughput_floor": 0}, "throughput_floor"),
        ({"method": "ngram", "verify_budget": "adaptive", "throughput_floor": 1.5}, "throughput_floor"),
        ({"method": "ngram", "verify_budget": "adaptive", "throughput_floor": "high"}, "throughput_floor"),
    ],
)
def test_bad_budget_keys(config, match):
    with pytest.raises(SpecDecodeError, match=match):
        parse_spec(config)


def test_auto_gamma_is_the_adaptive_budget_up_to_eight():
    auto = parse_spec({"method": "ngram", "num_speculative_tokens": "auto"})
    assert auto.num_speculative_tokens == 8 and auto.budget.verify_budget == "adaptive"
    assert parse_spec({"method": "dflash", "num_speculative_tokens": "auto"}).num_speculative_tokens == 16
    with pytest.raises(SpecDecodeError, match='"auto" chooses γ with the adaptive budget; drop verify_budget "fixed"'):
        parse_spec({"method": "ngram", "num_speculative_tokens": "auto", "verify_budget": "fixed"})
    with pytest.raises(SpecDecodeError, match='integer in \\[1, 32\\] or "auto", got \'often\''):
        parse_spec({"method": "ngram", "num_speculative_tokens": "often"})


def test_sts_calibrates_overconfident_survival_and_keeps_order():
    from specdecode.engine.calibration import Rounds, SequentialTemperatureScaling, expected_calibration_error

    g = torch.Generator().manual_seed(0)
    R, gamma = 4000, 4
    true = torch.rand(R, gamma, generator=g) * 0.6 + 0.2  # each token's real survival chance
    raw = torch.sigmoid(torch.logit(true) * 3.0)  # an overconfident estimator (same order)
    survived = torch.rand(R, gamma, generator=g) < true
    accepted = survived.long().cumprod(dim=1).sum(dim=1)
    rounds = Rounds(raw, torch.full((R,), gamma), accepted)
    sts = SequentialTemperatureScaling(gamma).fit(rounds)
    before, after = sts.survival_ece(rounds, calibrated=False), sts.survival_ece(rounds)
    assert after < before / 2
    assert (sts.temps > 1.5).all()  # it learned to soften
    order = raw[:, 0].argsort()
    assert (sts(raw)[:, 0][order].diff() >= 0).all()  # order-preserving
    # the planner's path in Python floats gives the same survival as the tensor path (including
    # a certain raw confidence, which both clamp)
    rows = raw[:50].tolist() + [[1.0, 0.0, 0.5, 1.0]]
    expected = torch.cumprod(sts(torch.tensor(rows)), dim=1)
    assert torch.tensor(sts.survival_rows(rows)) == pytest.approx(expected, abs=1e-5)
    assert expected_calibration_error(torch.tensor([0.9, 0.9]), torch.tensor([1.0, 0.0])) == pytest.approx(0.4)
