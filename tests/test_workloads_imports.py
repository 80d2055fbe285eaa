"""``kvbench.workloads`` is a leaf: it imports only itself, errors, fileio and units."""

from __future__ import annotations

import ast

from helpers import REPO

ALLOWED_KVBENCH = {"kvbench.errors", "kvbench.fileio", "kvbench.units"}


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_workloads_import_no_other_kvbench_package() -> None:
    files = sorted((REPO / "workloads").glob("*.py"))
    assert len(files) > 10
    for path in files:
        for name in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if name == "kvbench" or name.startswith("kvbench."):
                assert name in ALLOWED_KVBENCH, f"{path.name} imports {name}"
