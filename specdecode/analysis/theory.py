"""Leviathan et al.'s speedup model (Theorem 3.8): what a speculation config should buy.

Owns: expected tokens per round, expected speedup, and the optimal draft length γ,
for an i.i.d. per-position acceptance rate α and a draft/target step cost ratio c.
"""

from __future__ import annotations

import math

from specdecode.config import MAX_SPECULATIVE_TOKENS, SpecDecodeError


# Far past any useful draft length; a larger integer (10**400) would overflow the float formula.
MAX_THEORY_GAMMA = 10**6


def _check(alpha: float, gamma: int, c: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise SpecDecodeError(f"alpha must be in [0, 1], got {alpha}")
    if not 0 <= gamma <= MAX_THEORY_GAMMA:
        raise SpecDecodeError(f"gamma must be in [0, {MAX_THEORY_GAMMA}], got {gamma}")
    if not (math.isfinite(c) and c >= 0):
        raise SpecDecodeError(f"c must be a finite number >= 0, got {c}")


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens per round] = (1 − α^{γ+1}) / (1 − α): a geometric series capped at γ+1."""
    _check(alpha, gamma, 0.0)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float = 0.05, drafting: float = 1.0) -> float:
    """Speedup = (1 − α^{γ+1}) / ((1 − α)(γc + 1)), assuming verifying γ+1 positions costs one step.

    ``drafting`` < 1: only that share f of rounds has a draft (an n-gram or suffix lookup that
    finds no match drafts nothing); the others emit one token and pay no draft, so
    (f·E[tokens] + 1 − f) / (f·γc + 1). Measured α, γ and c are then those of drafting rounds."""
    _check(alpha, gamma, c)
    if not 0.0 <= drafting <= 1.0:
        raise SpecDecodeError(f"drafting must be in [0, 1], got {drafting}")
    return (drafting * expected_tokens_per_round(alpha, gamma) + 1.0 - drafting) / (drafting * gamma * c + 1.0)


def optimal_gamma(alpha: float, c: float = 0.05, max_gamma: int = MAX_SPECULATIVE_TOKENS) -> int:
    """The γ in [1, max_gamma] with the highest expected speedup (smallest γ on ties)."""
    return max(range(1, max_gamma + 1), key=lambda g: (expected_speedup(alpha, g, c), -g))
