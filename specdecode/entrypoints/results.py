"""The results page: one markdown file whose sections the benchmark commands replace.

Owns: `write_section` (put a section between its two markers, opening with the command that
made it, the date and the machine) and `machine` (CPU model and cores, or the GPU).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path


def machine() -> str:
    """The machine a figure was measured on: CPU model and the cores this process may use, and
    the GPU where one is visible."""
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


def write_section(path: str, name: str, body: str) -> None:
    """Put ``body`` (markdown) as section ``name`` of the results page ``path``, replacing the
    section's last measurement (between its two markers) or appending it. The section opens
    with the command that made it, the date and the machine."""
    argv0 = Path(sys.argv[0]).name
    if argv0 == "specdecode":
        command = "specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    else:
        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        where = os.path.relpath(os.getcwd(), Path(__file__).resolve().parents[2])  # from the repository's root
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
