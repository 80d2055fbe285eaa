"""The main job: `kvbench run` with no arguments must show both kinds of waste, and what they
mean, on one page.

The default suite queues every request at 0 s, so which request runs when depends only on
the KV managers, not on the clock: a simulated device with the same KV budget schedules
exactly what the CPU run does, in seconds instead of a minute.
"""

from __future__ import annotations

import base64
import importlib.util
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import REPO
from kvbench.cli.app import app
from kvbench.report.findings import FINDINGS_TITLE
from kvbench.results.schema import RunRecord, load_record

SIM = ["--device", "sim:a100-80gb", "--kv-memory", "8MiB"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("default")
    result = CliRunner().invoke(app, ["run", *SIM, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def _records(out: Path) -> dict[str, RunRecord]:
    return {p.stem: load_record(p) for p in out.glob("*.json")}


def test_the_default_suite_shows_both_kinds_of_waste(default_run) -> None:
    recs = {name: r.summary for name, r in _records(default_run[0]).items()}
    assert list(recs) and set(recs) >= {"contiguous", "contiguous-request", "paged"}
    contiguous, exact, paged = recs["contiguous"], recs["contiguous-request"], recs["paged"]
    # max_model_len reservations: most of the reserved KV never holds a token ...
    assert contiguous["kv_waste_pct"] > 50 and contiguous["kv_internal_waste_pct"] > 40
    # ... and equal extents tile the arena: a request never waits for a hole.
    assert contiguous["fragmentation_wait_steps"] == 0 and contiguous["min_frag_index"] == 1.0
    # Exact reservations waste little but leave holes too small for the next request.
    assert exact["kv_waste_pct"] < contiguous["kv_waste_pct"] / 2
    assert exact["fragmentation_wait_s"] > 0.2 * exact["duration_s"]
    assert exact["fragmentation_wait_largest_free_bytes"] < exact["fragmentation_wait_need_bytes"]
    assert exact["fragmentation_wait_need_bytes"] <= exact["fragmentation_wait_free_bytes"]
    assert exact["min_frag_index"] < 0.7  # below the reports' "healthy" threshold
    # Paged memory has neither, and runs the most requests at once.
    assert paged["kv_waste_pct"] < 5 and paged["fragmentation_wait_steps"] == 0
    assert paged["mean_concurrent_requests"] > 2 * contiguous["mean_concurrent_requests"]


def test_the_run_prints_what_it_shows_and_ends_with_its_page(default_run) -> None:
    out, output = default_run
    lines = output.strip().splitlines()
    assert lines[-1] == f"all of it on one page: {out / 'index.html'}"
    shown = output[output.index(FINDINGS_TITLE):]
    assert "contiguous-request: at t = " in shown and "largest hole" in shown
    summary = (out / "summary.md").read_text()
    assert f"## {FINDINGS_TITLE}" in summary and "contiguous-request: at t = " in summary


def test_the_page_holds_table_sentences_and_every_figure(default_run) -> None:
    out, _ = default_run
    page = (out / "index.html").read_text()
    assert FINDINGS_TITLE in page and "of which with enough KV free (s)" in page
    assert "kvbench run" in page and "machine" in page and "command" in page
    figures = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(figures) == len(list(out.glob("*.png"))) >= 5
    for data in figures:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    # The fragmentation figure comes right after the memory one, before the rest.
    names = re.findall(r"<img alt='([^']+)'", page)
    assert names[:2] == ["memory.png", "fragmentation.png"]
    # Nothing outside the page: no file or network references.
    assert not re.search(r"(src|href)='(?!data:)", page)


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", REPO / "benchmarks" /
                                                  "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_sample_is_rendered_from_records(default_run) -> None:
    quickstart = _quickstart()
    out, _ = default_run
    records = [load_record(out / f"{name}.json")
               for name in ("contiguous", "contiguous-request", "paged")]
    block = quickstart.render(records, "From a test.")
    assert block.startswith(quickstart.BEGIN) and block.endswith(quickstart.END)
    assert "| metric | contiguous | contiguous-request | paged |" in block
    assert "| of which with enough KV free (s) |" in block and "| TTFT p99 (ms) |" not in block
    assert "- contiguous-request: at t = " in block
    readme = (REPO / "README.md").read_text()
    assert readme.count(quickstart.BEGIN) == 1
    replaced = quickstart.replace_block(readme, block)
    assert replaced.count(quickstart.END) == 1 and "From a test." in replaced
    # The committed sample names the figure committed beside the run's summary.
    figure = re.search(r"\]\((results/tables/default/[^)]+\.png)\)", readme)
    assert figure and (REPO / figure[1]).is_file()


def test_report_and_publish_show_the_sentences_of_a_saved_run(default_run, tmp_path) -> None:
    out, _ = default_run
    runner = CliRunner()
    result = runner.invoke(app, ["report", str(out), "-o", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    report = (tmp_path / "report" / "report.md").read_text()
    result = runner.invoke(app, ["publish", str(out), "-o", str(tmp_path / "pub")])
    assert result.exit_code == 0, result.output
    tables = (tmp_path / "pub" / "tables.md").read_text()
    page = (tmp_path / "pub" / "index.html").read_text()
    summary = (out / "summary.md").read_text()
    sentence = next(line for line in summary.splitlines()
                    if line.startswith("- contiguous-request: at t = "))
    assert f"## {FINDINGS_TITLE}" in report and sentence in report
    assert f"### {FINDINGS_TITLE}" in tables and sentence in tables
    assert sentence[2:] in page
