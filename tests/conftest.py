"""Test-wide settings: tiny models run fastest on one thread (no OpenMP hand-offs); property
tests draw the same examples every run (CI must not pass or fail by the draw), unless
SPECDECODE_HYPOTHESIS=explore asks for fresh ones (and hypothesis' example database)."""

import os

import torch
from hypothesis import settings

torch.set_num_threads(1)
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("explore" if os.environ.get("SPECDECODE_HYPOTHESIS") == "explore" else "deterministic")
