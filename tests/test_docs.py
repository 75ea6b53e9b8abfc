"""The user guide builds with `mkdocs build --strict`: a broken link, a missing page in the
navigation or an API reference to something that no longer exists fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_guide_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("rejection_sample") > 0


def test_every_guide_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if p not in nav] == []


def test_the_readme_is_short_and_its_guide_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    for target in set(part.split(")")[0] for part in text.split("](docs/")[1:]):
        assert (ROOT / "docs" / target.split("#")[0]).exists(), target
