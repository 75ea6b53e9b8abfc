"""Sequential Temperature Scaling: per-position temperatures that make block survival honest."""

from __future__ import annotations

import math

import torch

from specdecode.engine.calibration import Rounds, SequentialTemperatureScaling, expected_calibration_error


def overconfident_rounds(n: int = 4000, gamma: int = 4, seed: int = 0) -> Rounds:
    """Rounds whose raw confidences claim 0.9 per token where each survives with 0.6."""
    g = torch.Generator().manual_seed(seed)
    survive = torch.rand(n, gamma, generator=g) < 0.6
    accepted = torch.where(survive.all(dim=1), gamma, (~survive).float().argmax(dim=1))
    return Rounds(torch.full((n, gamma), 0.9), torch.full((n,), gamma), accepted)


def test_fitting_lowers_the_survival_error_on_held_out_rounds():
    sts = SequentialTemperatureScaling(4).fit(overconfident_rounds(seed=0))
    test = overconfident_rounds(seed=1)
    before, after = sts.survival_ece(test, calibrated=False), sts.survival_ece(test)
    assert before > 0.2 and after < 0.05
    assert (sts.temps > 1).all()  # overconfidence is cooled at every position


def test_positions_with_too_few_rounds_keep_temperature_one():
    rounds = overconfident_rounds(n=40)
    rounds = Rounds(rounds.raw, torch.full((40,), 2), rounds.accepted.clamp(max=2))
    sts = SequentialTemperatureScaling(4).fit(rounds, min_rounds=8)
    assert sts.temps[2:].tolist() == [1.0, 1.0]


def test_survival_rows_match_the_tensor_path():
    sts = SequentialTemperatureScaling(3)
    sts.temps = torch.tensor([1.0, 2.0, 0.5])
    raw = [[0.9, 0.8, 0.7], [0.5, 0.99, 0.2]]
    rows = sts.survival_rows(raw)
    want = torch.cumprod(sts(torch.tensor(raw)), dim=1)
    assert all(math.isclose(a, float(b), rel_tol=1e-6) for r, w in zip(rows, want) for a, b in zip(r, w))
    assert all(r[0] >= r[1] >= r[2] for r in rows)  # survival never rises with depth


def test_ece_of_a_perfect_predictor_is_zero_and_of_a_wrong_one_is_not():
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert expected_calibration_error(torch.tensor([1.0, 0.0, 1.0, 0.0]), outcome) == 0.0
    assert expected_calibration_error(torch.tensor([0.0, 1.0, 0.0, 1.0]), outcome) == 1.0
