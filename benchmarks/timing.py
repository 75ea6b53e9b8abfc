"""Shared by the benchmark scripts (run as `python benchmarks/<script>.py`, so this imports as `timing`)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable


class Timer:
    """Wraps one method of an object (e.g. a drafter's ``propose``) and adds up its time on
    ``clock``: wall time by default; `time.process_time` where the figures it is set against
    are CPU seconds (all threads' together)."""

    def __init__(self, obj, name: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner, self.seconds, self.calls, self.clock = getattr(obj, name), 0.0, 0, clock
        setattr(obj, name, self)

    def __call__(self, *a):
        t0 = self.clock()
        out = self.inner(*a)
        self.seconds += self.clock() - t0
        self.calls += 1
        return out


def paired_interval(ratios: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The geometric mean of paired ratios and its two-sided ``level`` t interval (over their
    logs: a ratio of 0.5 is as far from 1 as one of 2). One ratio gives no interval."""
    from scipy.stats import t

    if not ratios or min(ratios) <= 0 or not all(math.isfinite(r) for r in ratios):
        raise ValueError(f"paired ratios must be positive and finite, got {ratios}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = 0.0
    if len(logs) > 1:
        half = t.ppf((1 + level) / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
