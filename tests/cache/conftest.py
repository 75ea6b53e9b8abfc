"""The tiny fp32 llama the cache tests run passes through."""

from __future__ import annotations

import pytest
import torch

from specdecode.model.loader import load_model
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=4)
    return load_model(str(folder), dtype=torch.float32, device="cpu", progress=False).model
