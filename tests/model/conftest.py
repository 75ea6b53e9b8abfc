"""Model tests write conversions and compiled kernels to a temp cache, except tests that
ask for ``real_cache``: real models convert once into the user's cache."""

import pytest

from tests.tiny import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def _cache(request, tmp_path, monkeypatch):
    if "real_cache" not in request.fixturenames:
        monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def real_cache():
    """Marker fixture: use ``$SPECDECODE_CACHE`` or ~/.cache/specdecode as the user would."""


@pytest.fixture(scope="module", params=["llama", "llama_untied"])
def tiny_folder(request, tmp_path_factory):
    """A tiny llama checkpoint, tied and untied (quantized models: test_quant*.py)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, hidden_size=128)
