"""Shared by the benchmark scripts (run as `python benchmarks/<script>.py`, so this imports as `timing`)."""

from __future__ import annotations

import time


class Timer:
    """Wraps one method of an object (e.g. a drafter's ``propose``) and adds up its wall time."""

    def __init__(self, obj, name: str) -> None:
        self.inner, self.seconds, self.calls = getattr(obj, name), 0.0, 0
        setattr(obj, name, self)

    def __call__(self, *a):
        t0 = time.perf_counter()
        out = self.inner(*a)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out
