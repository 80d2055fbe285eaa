"""Dependencies point one way. Every module's imports (function-level ones included) are
parsed and checked against the layering of DESIGN.md:

- ``workloads`` and ``kernels`` are leaves: they import only themselves and the base modules;
- ``engines`` never imports the run, results, report, tools or CLI code;
- record readers (the schema, record sets, repeats) and everything under ``report`` import
  only the record schema side and the base modules, never the run loop or the engines;
- nothing but the CLI imports the CLI;
- results never import the run code (the run log they read lives in ``results.runlog``);
- no modules import each other, directly or round a loop (``if TYPE_CHECKING:`` aside).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folders and the package each is installed as.
FOLDERS = {"kvbench": "kvbench"}
BASE = ("kvbench.errors", "kvbench.units", "kvbench.fileio")
READERS = ("kvbench.results.schema", "kvbench.results.recordset", "kvbench.results.repeats",
           "kvbench.results.slo", "kvbench.results.metric_table", "kvbench.results.paths")
# package prefix -> prefixes it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "kvbench.engines": ("kvbench.run", "kvbench.results", "kvbench.report", "kvbench.tools",
                        "kvbench.cli"),
    "kvbench.results": ("kvbench.run", "kvbench.report", "kvbench.tools", "kvbench.cli"),
    "kvbench.run": ("kvbench.report.compare", "kvbench.cli"),
    "kvbench.tools": ("kvbench.cli",),
}
# A calibration profile is an input of runs (``--device sim:PROFILE.json``).
ALLOWED = {"kvbench.run": ("kvbench.tools.calibrate.profile",)}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (never run, so never an import cycle)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(path: Path, module: str, *, runtime: bool = False) -> set[str]:
    """The kvbench modules ``module`` imports; ``runtime``: not those under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_only(tree) if runtime else set()
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # In a package's __init__, level 1 is the package itself.
                up = node.level - (path.name == "__init__.py")
                base = module.rsplit(".", up)[0] if up else module
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.add(name)
            # `from kvbench.cli import regress` imports the module kvbench.cli.regress
            found.update(f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in MODULES)
    return {n for n in found if n == "kvbench" or n.startswith("kvbench.")}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(module: str, imports: set[str]) -> list[str]:
    bad = []
    leaf = next((p for p in ("kvbench.workloads", "kvbench.kernels") if _under(module, p)), None)
    reader = module in READERS or _under(module, "kvbench.report")
    for name in sorted(imports):
        if leaf is not None:
            if not (_under(name, leaf) or name in BASE):
                bad.append(name)
            continue
        if reader and not (name in BASE or name in READERS or _under(name, "kvbench.report")
                           or name == "kvbench"):
            bad.append(name)
            continue
        for prefix, forbidden in FORBIDDEN.items():
            if _under(module, prefix) and any(_under(name, f) for f in forbidden):
                allowed = ALLOWED.get(prefix, ())
                if not any(_under(name, a) for a in allowed):
                    bad.append(name)
        if _under(name, "kvbench.cli") and not _under(module, "kvbench.cli"):
            bad.append(name)
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_one_way(module: str) -> None:
    imports = _imports(MODULES[module], module)
    assert not _violations(module, imports), f"{module} imports {_violations(module, imports)}"


def test_the_rules_catch_a_violation() -> None:
    assert _violations("kvbench.engines.builtin.engine", {"kvbench.run.harness"})
    assert _violations("kvbench.kernels.reference", {"kvbench.engines.kv.base"})
    assert _violations("kvbench.report.plots", {"kvbench.run.harness"})
    assert _violations("kvbench.workloads.io", {"kvbench.run.suite"})
    assert _violations("kvbench.results.metrics", {"kvbench.run.harness"})
    assert not _violations("kvbench.engines.builtin.engine",
                           {"kvbench.kernels.layouts", "kvbench.errors"})
    assert "kvbench.run.execute" in MODULES and "kvbench.engines.kv.paged" in MODULES


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node, each sorted
    (Tarjan's algorithm, iterative: an import chain may be deeper than Python's stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import loop through the component's first module, within the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    for node in queue:
        for child in sorted(graph.get(node, set()) & members):
            if child == start:
                return [*paths[node], start]
            if child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    return component


def test_no_import_cycles() -> None:
    graph = {m: (_imports(p, m, runtime=True) & MODULES.keys()) - {m} for m, p in MODULES.items()}
    cycles = [" -> ".join(_loop(graph, c)) + f"  ({len(c)} modules: {', '.join(c)})"
              for c in _components(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_finder_catches_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a", "f"},
             "f": {"e"}, "g": {"g"}}
    assert _components(graph) == [["a", "b", "c"], ["e", "f"]]
    assert _loop(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _components({"a": {"b"}, "b": set()}) == []


def test_runtime_imports_leave_out_type_checking_blocks(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import typing\nimport kvbench.errors\nif typing.TYPE_CHECKING:\n"
                    "    from kvbench.cli import app\nelse:\n    import kvbench.units\n")
    assert _imports(path, "kvbench.m", runtime=True) == {"kvbench.errors", "kvbench.units"}
    assert "kvbench.cli" in _imports(path, "kvbench.m")


def test_every_package_ships_in_the_wheel() -> None:
    """pyproject.toml lists packages one by one: a new sub-package left out of the list
    imports from a checkout but is missing from an installed wheel."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {"kvbench": root / "kvbench"}
    dirs.update({name: root / path for name, path in setup["package-dir"].items()})
    listed = set(setup["packages"])
    for name, base in dirs.items():
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            package = ".".join((name, *rel))
            # A folder mapped on its own (kvbench.engines.kv) is checked under its name.
            if package not in dirs or package == name:
                assert package in listed, f"{package} is not in pyproject's packages"
