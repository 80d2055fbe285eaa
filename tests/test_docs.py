"""The documentation: the generated metric reference, the site's pages and links, the README."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import yaml

from kvbench.results.metric_table import CURVES, METRICS

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# Markdown links, images included: [text](target) with no space in the target.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_metrics", DOCS / "gen_metrics.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_metric_reference_matches_the_metric_table() -> None:
    committed = (DOCS / "metric-reference.md").read_text(encoding="utf-8")
    assert committed == _generator().render(), (
        "docs/metric-reference.md differs from the metric table: run python docs/gen_metrics.py")


def test_metric_reference_has_a_row_per_metric_and_curve() -> None:
    rows = [line for line in _generator().render().splitlines() if line.startswith("| `")]
    names = [row.split("`")[1] for row in rows]
    assert names == [spec.name for spec in (*METRICS, *CURVES)]
    gated = next(row for row in rows if row.startswith("| `kv_waste_pct` |"))
    assert "| lower |" in gated


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav))
    assert set(nav) == {page.name for page in DOCS.glob("*.md")}


def test_links_between_pages_stay_inside_the_site() -> None:
    # mkdocs build --strict refuses a link to a file outside docs/ or to a missing page.
    for page in DOCS.glob("*.md"):
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "#")):
                continue
            path = target.partition("#")[0]
            assert (DOCS / path).is_file() and "/" not in path, f"{page.name}: {target}"


def test_readme_is_a_guide_that_links_to_existing_pages() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 300
    docs_links = [t for t in LINK.findall(readme) if t.startswith("docs/")]
    assert docs_links and all((REPO / t.partition("#")[0]).is_file() for t in docs_links)
    for command in ("kvbench compare", "kvbench soak", "kvbench capacity", "kvbench claims",
                    'kind = "openai"', "nox -s docs"):
        assert command in readme, command
