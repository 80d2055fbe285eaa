"""Published tables: Markdown, CSV and a self-contained HTML page from many run folders."""

from __future__ import annotations

import base64
import csv
import io
import re
from pathlib import Path

import pytest
from record_factory import MACHINE, changed, make_record, write
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.results.repeats import fold_repeats

# A 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


def _publish(tmp_path: Path, *dirs: Path) -> Path:
    out = tmp_path / "tables"
    result = CliRunner().invoke(app, ["publish", *map(str, dirs), "-o", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_publish_merges_shards_and_machines(tmp_path: Path) -> None:
    write(make_record("paged", suite="sim"), tmp_path / "shard-1" / "sim")
    write(make_record("contiguous", suite="sim"), tmp_path / "shard-2" / "sim")
    (tmp_path / "shard-1" / "sim" / "memory.png").write_bytes(PNG)
    gpu = {**MACHINE, "gpu": {"name": "NVIDIA H200", "count": 1, "cuda": "13.0"}}
    write(make_record("paged", suite="cpu", clock="wall"), tmp_path / "a" / "cpu")
    write(make_record("paged", suite="cpu", clock="wall", machine=gpu), tmp_path / "b" / "cpu")
    out = _publish(tmp_path, tmp_path / "shard-1", tmp_path / "shard-2", tmp_path / "a",
                   tmp_path / "b")

    md = (out / "tables.md").read_text()
    assert "## cpu" in md and "## sim" in md
    sim = md[md.index("## sim"):]
    assert "| metric | paged | contiguous |" in sim
    assert "`d1g3st`" in sim and "`kvbench run sim`" in sim
    # One engine on two machines: a column each, named by machine.
    cpu = md[md.index("## cpu"):md.index("## sim")]
    assert "paged (test-x4-torch2.13)" in cpu and "paged (nvidia-h200-x1-cuda13.0" in cpu
    assert "NVIDIA H200" in cpu

    rows = list(csv.DictReader(io.StringIO((out / "tables.csv").read_text())))
    peak = [r for r in rows if r["suite"] == "sim" and r["metric"] == "peak_kv_reserved_bytes"]
    assert {r["engine"] for r in peak} == {"paged", "contiguous"}
    assert all(float(r["value"]) == 6 << 20 for r in peak)

    page = (out / "index.html").read_text()
    assert "data:image/png;base64," + base64.b64encode(PNG).decode() in page
    # Self-contained: nothing to fetch.
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page)
    assert "<th>contiguous</th>" in page and "d1g3st" in page


def test_publish_reports_repeats(tmp_path: Path) -> None:
    rec = make_record(clock="wall")
    folded = fold_repeats([changed(rec, median_ttft_ms=v) for v in (90.0, 100.0, 130.0)])
    write(folded, tmp_path / "run")
    out = _publish(tmp_path, tmp_path / "run")
    assert "medians over the repeats" in (out / "tables.md").read_text()
    rows = list(csv.DictReader(io.StringIO((out / "tables.csv").read_text())))
    (ttft,) = [r for r in rows if r["metric"] == "median_ttft_ms"]
    assert float(ttft["value"]) == 100.0 and ttft["repeats"] == "3"
    assert float(ttft["spread"]) == pytest.approx(1.4826 * 10)
