"""Calibrating draft-token confidences: Sequential Temperature Scaling (STS) and ECE.

Owns: turning raw per-position confidences c_k (the estimated chance that draft token k
survives given tokens 1..k-1 did) into calibrated ones, and measuring calibration.
Does not own: where raw confidences come from (engine/acceptance.py) or how they are spent
(engine/adaptive.py).

STS (DSpark): one temperature per draft position, c'_k = σ(logit(c_k) / T_k). Scaling a
logit by a positive constant keeps the order of confidences at each position, so the
scheduler's ranking within a position is unchanged; only the values move. The
temperatures are fitted left to right: T_1 first, then T_2 with T_1 fixed, and so on,
each by a 1-D grid search minimising the expected calibration error of the *cumulative*
survival S_k = c'_1 · … · c'_k against whether the first k tokens were all accepted,
over the rounds that drafted at least k tokens. The survival of a block, not the
single-token confidence, is what the scheduler multiplies into expected tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TEMPERATURES = torch.exp(torch.linspace(-2.5, 2.5, 41))  # the grid: about 0.08 .. 12
EPS = 1e-4


def expected_calibration_error(pred: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> float:
    """ECE: Σ over equal-width bins of |mean prediction − observed rate| · (bin share)."""
    if pred.numel() == 0:
        return 0.0
    return float(expected_calibration_errors(pred.flatten().float()[None], outcome.flatten().float(), bins)[0])


def expected_calibration_errors(pred: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> torch.Tensor:
    """[T] the ECE of each row of predictions ``pred`` [T, N] against one ``outcome`` [N]
    (a bin no prediction fell in adds |0 − 0|)."""
    which = (pred * bins).long().clamp(0, bins - 1)
    conf = torch.zeros(pred.shape[0], bins).scatter_add_(1, which, pred)
    hits = torch.zeros(pred.shape[0], bins).scatter_add_(1, which, outcome.expand_as(pred))
    return (conf - hits).abs().sum(dim=1) / pred.shape[1]


@dataclass
class Rounds:
    """Verification records: raw confidences [R, γ], tokens drafted [R] and accepted [R]."""

    raw: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor

    def survival_targets(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rounds that drafted at least k + 1 tokens, and whether their first k + 1 were all accepted."""
        reached = self.drafted > k
        return reached, (self.accepted[reached] > k).float()


def _scaled(raw: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    logit = torch.logit(raw.clamp(EPS, 1 - EPS))
    return torch.sigmoid(logit / temps)


class SequentialTemperatureScaling:
    """Per-position temperatures for raw conditional confidences [.., γ]."""

    def __init__(self, gamma: int) -> None:
        self.temps = torch.ones(gamma)

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional confidences, same shape as ``raw`` [.., k ≤ γ]."""
        k = raw.shape[-1]
        return _scaled(raw, self.temps[:k])

    def survival_rows(self, raw: list[list[float]]) -> list[list[float]]:
        """Calibrated block survival s_k = c_1 · … · c_k of each row of raw c_k, in Python floats:
        the planner's path (torch's per-op cost made a third of a planning at one row)."""
        temps = self.temps.tolist()
        out = []
        for row in raw:
            s, survival = 1.0, []
            for c, t in zip(row, temps):
                c = min(max(c, EPS), 1 - EPS)
                if t != 1.0:
                    c = 1.0 / (1.0 + math.exp(-math.log(c / (1 - c)) / t))
                s *= c
                survival.append(s)
            out.append(survival)
        return out

    def fit(self, rounds: Rounds, min_rounds: int = 8) -> "SequentialTemperatureScaling":
        """Fit T_1, T_2, … in order; a position with fewer than ``min_rounds`` records keeps T = 1."""
        gamma = self.temps.numel()
        survival = torch.ones(rounds.raw.shape[0])  # S_{k-1} under the temperatures fitted so far
        for k in range(min(gamma, rounds.raw.shape[1])):
            reached, target = rounds.survival_targets(k)
            if int(reached.sum()) < min_rounds:
                break
            prefix, raw_k = survival[reached], rounds.raw[reached, k]
            candidates = prefix[None, :] * _scaled(raw_k[None, :], TEMPERATURES[:, None])  # [T, R]: each temperature
            self.temps[k] = TEMPERATURES[int(expected_calibration_errors(candidates, target).argmin())]
            survival = survival * _scaled(rounds.raw[:, k], self.temps[k])
        return self

    def survival_ece(self, rounds: Rounds, calibrated: bool = True) -> float:
        """ECE of cumulative survival over every (round, position) pair that was drafted."""
        conf = self(rounds.raw) if calibrated else rounds.raw.clamp(EPS, 1 - EPS)
        survival = torch.cumprod(conf, dim=1)  # [R, γ]
        k = torch.arange(rounds.raw.shape[1])[None, :]
        drafted = k < rounds.drafted[:, None]
        return expected_calibration_error(survival[drafted], (k < rounds.accepted[:, None])[drafted])
