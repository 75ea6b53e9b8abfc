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


def machine() -> str:
    """The machine a figure was measured on: CPU model and the cores this process may use, and
    the GPU where one is visible."""
    import os
    import platform

    import torch

    model = platform.processor() or "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{model}, {cores} cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def write_results(path: str, name: str, body: str) -> None:
    """Put ``body`` (markdown) as section ``name`` of the results page ``path``, replacing the
    section's last measurement (between its two markers) or appending it. The section opens
    with the command that made it, the date and the machine."""
    import datetime
    import shlex

    import os

    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    where = os.path.relpath(os.getcwd(), Path(__file__).resolve().parents[1])  # from the repository's root
    if where != ".":
        command = f"cd {shlex.quote(where)} && {command}"
    stamp = f"`{command}`  \n{datetime.date.today().isoformat()}, {machine()}\n\n"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{stamp}{body.rstrip()}\n{end}"
    page = Path(path)
    text = page.read_text() if page.exists() else "# Results\n"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    page.write_text(text)
