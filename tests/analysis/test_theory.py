import pytest

from specdecode.config import SpecDecodeError
from specdecode.analysis.theory import expected_speedup, expected_tokens_per_round, optimal_gamma

# The seed's table 10-16 (c = 0.05).
SEED_TABLE = [(0.6, 4, 2.31, 1.92), (0.8, 4, 3.36, 2.80), (0.8, 8, 4.33, 3.09), (0.9, 4, 4.10, 3.41)]


@pytest.mark.parametrize("alpha,gamma,tokens,speedup", SEED_TABLE)
def test_seed_table(alpha, gamma, tokens, speedup):
    assert round(expected_tokens_per_round(alpha, gamma), 2) == tokens
    assert round(expected_speedup(alpha, gamma, 0.05), 2) == speedup


def test_draft_cost_hurts():
    assert round(expected_speedup(0.8, 4, 0.2), 2) == 1.87


def test_rounds_without_a_draft_emit_one_token_and_pay_no_draft():
    # a quarter of the rounds draft: (0.25 * 3.3616 + 0.75) / (0.25 * 4 * 0.2 + 1) = 1.5904 / 1.2
    assert expected_speedup(0.8, 4, 0.2, drafting=0.25) == pytest.approx(1.32533, abs=1e-5)
    assert expected_speedup(0.8, 4, 0.2, drafting=1.0) == expected_speedup(0.8, 4, 0.2)
    assert expected_speedup(0.8, 4, 0.2, drafting=0.0) == 1.0
    with pytest.raises(SpecDecodeError, match="drafting must be in"):
        expected_speedup(0.8, 4, 0.2, drafting=1.5)


def test_optimal_gamma_matches_seed_reading():
    # "α = 0.8 peaks near γ = 8 (3.09×); α = 0.6 peaks at γ = 4".
    assert optimal_gamma(0.8, 0.05) in (7, 8)
    assert optimal_gamma(0.6, 0.05) == 4
    assert expected_tokens_per_round(1.0, 4) == 5.0


def test_bounds():
    with pytest.raises(SpecDecodeError):
        expected_speedup(1.5, 4)
    with pytest.raises(SpecDecodeError):
        expected_speedup(0.5, 4, -1.0)
