"""No lab notes in the repository's files: what the code and docs say must hold for whoever
reads them, wherever they run it. The repository is a product; its history lives in git, and
what was measured, with its machine, lives on docs/results.md (written by the benchmark
scripts). So no tracked text file may name the development machine, a round of work, an issue
number or the retired benchmark page.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Case-insensitive. None of them matches its own source text, so this file is checked too.
FORBIDDEN = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bthis (cpu|machine|vm)\b",  # the development machine: say what the code needs instead
        r"docs/benchmarks\.md",  # retired: results are on docs/results.md
        # history belongs to git log
        r"\b(in|from|of) (the|a|an|this|earlier|later|the earlier|the later|an earlier|a later) (session|sessions)\b",
        r"\bsession[s]? (note|notes)\b",
        r"\bissue (#)?\d+\b",  # a tracker's numbering means nothing to a reader of the code
    )
]
SKIP_SUFFIXES = (".png", ".json", ".safetensors", ".npy", ".gguf")
SKIP_UNDER = ("specdecode/weights/",)


def tracked_text_files() -> list[tuple[str, str]]:
    """(path, text) of every tracked text file, binary files and shipped weights left out."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or no git): nothing tracked to check")
    out = []
    for name in listed.decode().split("\0"):
        if not name or name.lower().endswith(SKIP_SUFFIXES) or name.startswith(SKIP_UNDER):
            continue
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            out.append((name, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def test_no_lab_notes_in_tracked_files():
    files = tracked_text_files()
    assert files, "git ls-files listed no text files"
    found = []
    for name, text in files:
        for number, line in enumerate(text.splitlines(), start=1):
            for pattern in FORBIDDEN:
                match = pattern.search(line)
                if match:
                    found.append(f"{name}:{number}: {match.group(0)!r} in {line.strip()[:160]}")
    assert not found, f"{len(found)} lab note(s) in tracked files:\n" + "\n".join(found)
