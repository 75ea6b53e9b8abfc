"""The server tests' tiny target, loaded once per module, and a live server over it."""

import pytest

from specdecode.model.loader import load_model
from tests.entrypoints.server_helpers import ServerThread, make_app
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", "llama", seed=0))


@pytest.fixture(scope="module")
def target(ckpt):
    return load_model(ckpt, dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def served(target):
    """The speculative server (server_helpers.make_app) on a loopback thread."""
    with ServerThread(make_app(target)) as srv:
        yield srv
