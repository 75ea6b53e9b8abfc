"""The benchmarks' paired statistic (benchmarks/timing.py: bench_serving.py prints it beside each
pooled ratio it decides "met" by)."""

import importlib.util
from pathlib import Path

import pytest


def _timing():
    path = Path(__file__).parents[2] / "benchmarks" / "timing.py"
    spec = importlib.util.spec_from_file_location("timing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_interval_is_the_t_interval_of_the_log_ratios():
    paired_interval = _timing().paired_interval
    # by hand: logs 0.0953102, -0.1053605, 0; mean -0.0033501, sd 0.1003773, se 0.0579529;
    # t(0.975, 2 df) = 4.3026527, half width 0.2493510
    mean, lo, hi = paired_interval([1.1, 0.9, 1.0])
    assert mean == pytest.approx(0.996655, abs=1e-6)
    assert lo == pytest.approx(0.776700, abs=1e-5)
    assert hi == pytest.approx(1.278901, abs=1e-5)
    assert paired_interval([1.05]) == pytest.approx((1.05, 1.05, 1.05))  # one ratio: no interval
    assert paired_interval([2.0, 0.5])[0] == pytest.approx(1.0)  # a halving is as far from 1 as a doubling
    for bad in ([], [1.0, 0.0], [float("inf")]):  # a timing of 0 (a clock too coarse): one clear error
        with pytest.raises(ValueError, match="positive and finite"):
            paired_interval(bad)
