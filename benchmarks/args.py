"""Shared by the benchmark scripts' command lines (imported as `args`, like timing.py): argparse
types that refuse a bad value when the arguments are parsed, before any model loads, and `run`,
which gives the library's errors as one line ``error: ...`` with exit code 2, as the CLI does."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

from specdecode.config import SpecDecodeError
from specdecode.entrypoints.results import machine, write_section as write_results  # noqa: F401 (the scripts' import)


def int_at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (``why``, if given, says why in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}{why}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)
decode_tokens = int_at_least(2, " (a decode rate needs a token after the first)")


def nonneg_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def unit_float(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def device(text: str) -> str:
    """An argparse type: cpu, cuda or cuda:N (whether that device exists is the loader's to say)."""
    if text not in ("cpu", "cuda") and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def out_path(text: str) -> str:
    """An argparse type: a file to write at the end of a run, in a folder that exists now (not
    found after the run, it would lose the results)."""
    path = Path(text).expanduser()  # as the shell would have: "--json=~/x.json" is not expanded
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {str(path.parent)!r} to write {text!r} in")
    return str(path)


def run(main: Callable[[], int]) -> int:
    """``main()``'s exit code; the library's errors as one line on stderr (exit code 2), Ctrl-C quietly (130)."""
    try:
        return main()
    except SpecDecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

