"""Report modules and result readers depend only on the record schema and base modules: they
read saved records, so they must never need the run loop, the engines or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO

READERS = [
    *sorted((REPO / "kvbench" / "report").glob("*.py")),
    *(REPO / "kvbench" / "results" / f"{name}.py"
      for name in ("schema", "recordset", "repeats", "metric_table", "paths", "slo")),
]
FORBIDDEN = ("kvbench.run", "kvbench.engines", "kvbench.cli", "kvbench.tools",
             "kvbench.workloads", "kvbench.kernels")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", READERS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_reader_imports(path: Path) -> None:
    bad = sorted(m for m in _imports(path) if m.startswith(FORBIDDEN))
    assert not bad, f"{path.name} imports {bad}"
