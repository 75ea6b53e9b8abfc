"""Model tests write conversions and compiled kernels to a temp cache, except tests that
ask for ``real_cache``: real models convert once into the user's cache."""

import pytest


@pytest.fixture(autouse=True)
def _cache(request, tmp_path, monkeypatch):
    if "real_cache" not in request.fixturenames:
        monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def real_cache():
    """Marker fixture: use ``$SPECDECODE_CACHE`` or ~/.cache/specdecode as the user would."""
