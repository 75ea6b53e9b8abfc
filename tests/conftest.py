"""Test-wide settings: tiny models run fastest on one thread (no OpenMP hand-offs)."""

import torch

torch.set_num_threads(1)
