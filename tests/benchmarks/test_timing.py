"""The benchmarks' paired statistic (benchmarks/timing.py: bench_serving.py prints it beside each
pooled ratio it decides "met" by, bench_learned.py gives its speedups' intervals)."""

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


def test_bench_learned_intervals_are_over_prompts_not_repetitions(monkeypatch):
    """Repetitions of a prompt differ by timing noise only: counted as independent samples they
    made the interval far too narrow (the prompt is the sampling unit)."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "timing", raising=False)
    import bench_learned

    per_prompt = {0: [1.02, 1.03, 1.01], 1: [1.1, 1.12, 1.09], 2: [1.3, 1.28, 1.31]}
    # the labels (a prompt's first 36 characters) may be one: "Summarize the following text in a..."
    rows = [{"kind": "summarize", "prompt": "Summarize the following text", "prompt_index": i, "speedup": s}
            for i, ss in per_prompt.items() for s in ss]  # fmt: skip
    means = [bench_learned.geomean(ss) for ss in per_prompt.values()]
    mean, lo, hi = _timing().paired_interval(means)
    assert bench_learned.speedup(rows) == f"{mean:.2f}x [{lo:.2f}–{hi:.2f}]" and lo < 0.9  # 9 samples: [1.06–1.21]
