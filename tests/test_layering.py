"""The package's import graph: no cycles, and layers import downward only
(entrypoints and train → engine → drafters → model / cache / core / analysis → config).

Imports under ``if TYPE_CHECKING:`` are for annotations only and do not count; imports inside
functions do.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "specdecode"

# lowest first; a package not named here is in the model / cache / core / analysis layer
LAYERS = {"config": 0, "drafters": 2, "engine": 3, "train": 4, "entrypoints": 4, "": 4}


def layer(module: str) -> int:
    first = module.removeprefix("specdecode").lstrip(".").split(".")[0]
    return LAYERS.get(first, 1)


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("specdecode", *path.relative_to(ROOT).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}  # fmt: skip
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdecode"):
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("specdecode")}
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n) :] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_layers_import_downward_only():
    g = graph()
    upward = sorted((m, n) for m, targets in g.items() for n in targets if layer(n) > layer(m))
    assert upward == [], f"imports from a higher layer: {upward}"
