"""Fixtures for the trainer's tests: one tiny random target and a tiny corpus of word salad.

The corpus draws from a dozen words, so a few dozen steps teach a drafter what the
target does with them: held-out loss falls and acceptance rises within a second.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.tiny import make_tiny_checkpoint

WORDS = ("the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "and", "then", "slept")


def write_corpus(root: Path, num_docs: int = 20, words_per_doc: int = 150, seed: int = 0) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_docs):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words_per_doc)) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("train") / "target", "llama", seed=0))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    return str(write_corpus(tmp_path_factory.mktemp("train") / "corpus"))
