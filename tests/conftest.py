"""Test-wide settings: tiny models run fastest on one thread (no OpenMP hand-offs); property
tests draw the same examples every run (CI must not pass or fail by the draw), unless
SPECDECODE_HYPOTHESIS=explore asks for fresh ones (and hypothesis' example database)."""

import itertools
import os

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("explore" if os.environ.get("SPECDECODE_HYPOTHESIS") == "explore" else "deterministic")


@pytest.fixture
def virtual_clock(monkeypatch):
    """The engine's clock (engine/cost.py `clock`, as serving and the adaptive budget read it)
    advances 1 ms at every reading: what an adaptive budget measures, and so decides, is then
    the same on a quiet and a busy machine. Use it before an engine is built (its verify cost
    is measured at construction)."""
    from specdecode.engine import adaptive, cost, serving

    ticks = itertools.count()

    def clock(device=None, wait=True) -> float:
        return next(ticks) * 1e-3

    for module in (adaptive, cost, serving):
        monkeypatch.setattr(module, "clock", clock)
    return clock
