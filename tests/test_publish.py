"""Published tables: Markdown, CSV and a self-contained HTML page from many run folders."""

from __future__ import annotations

import base64
import csv
import io
import re
from pathlib import Path

import pytest
from cli_main import cli, run_main
from record_factory import MACHINE, changed, make_record, write
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.results.paths import redact_home, redact_paths
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


# --- privacy ------------------------------------------------------------------------------

HOST = "build-host-42"
PRIVATE = {**MACHINE, "hostname": f"{HOST}.lab.example.com"}
COMMAND = (f"kvbench run --workload mooncake:/home/alice/traces/mooncake.jsonl "
           f"--out /mnt/{HOST}/runs/sim --shard 1/2")


def _private_run(tmp_path: Path) -> Path:
    rec = make_record("paged", suite="sim", machine=PRIVATE)
    wl = rec.workload.model_copy(update={"source": "mooncake /home/alice/traces/mooncake.jsonl"})
    folder = tmp_path / "runs" / HOST
    write(rec.model_copy(update={"command": COMMAND, "workload": wl}), folder)
    (folder / "memory.png").write_bytes(PNG)
    return folder


def _published(tmp_path: Path, *extra: str) -> str:
    out = tmp_path / "tables"
    result = CliRunner().invoke(app, ["publish", str(tmp_path / "runs"), "-o", str(out), *extra],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return "\n".join((out / name).read_text() for name in ("tables.md", "tables.csv",
                                                             "index.html"))


@pytest.mark.parametrize(("text", "public"), [
    ("--workload mooncake:/home/alice/t.jsonl --out=/mnt/x/runs/", "--workload mooncake:…/t.jsonl "
     "--out=…/runs/"),
    ("C:\\Users\\alice\\trace.csv", "…/trace.csv"),
    ("100 requests, 1000 prompt / 1000 output tokens", None),
    ("KV utilization (used/reserved), shard 1/2, ~/traces/t.csv", None),
    ("runs/build-host-42/x and build-host-42.lab.example.com", "runs/{host}/x and {host}"),
    ("build-host-421 rebuild-host-42", None),
])
def test_redact_paths(text: str, public: str | None) -> None:
    hosts = ["build-host-42.lab.example.com"]
    assert redact_paths(text, hosts) == (text if public is None else public)
    assert redact_paths(redact_paths(text, hosts), hosts) == redact_paths(text, hosts)


def test_redact_home() -> None:
    cmd = "kvbench run --out /home/alice/runs --workload azure:/home/alice/t.csv /home/alice2/x"
    assert redact_home(cmd, "/home/alice") == (
        "kvbench run --out ~/runs --workload azure:~/t.csv /home/alice2/x"
    )


def test_publish_leaves_out_hostname_and_absolute_paths(tmp_path: Path) -> None:
    _private_run(tmp_path)
    text = _published(tmp_path)
    assert HOST not in text and "/home/alice" not in text and "/mnt/" not in text
    assert str(tmp_path) not in text
    # What stays is what a reader needs to rerun it.
    assert "mooncake:…/mooncake.jsonl" in text and "--out …/sim --shard 1/2" in text
    assert "{host}/memory.png" in text


def test_publish_include_host_shows_them(tmp_path: Path) -> None:
    _private_run(tmp_path)
    text = _published(tmp_path, "--include-host")
    assert f"{HOST}.lab.example.com: Test CPU x4" in text
    assert COMMAND in text and f"{HOST}/memory.png" in text


def test_publish_writes_nothing_when_a_table_cannot_be_rendered(
    tmp_path: Path, monkeypatch
) -> None:
    write(make_record(), tmp_path / "run")
    out = tmp_path / "tables"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("kvbench.report.publish.html_page", interrupted)
    result = CliRunner().invoke(app, ["publish", str(tmp_path / "run"), "-o", str(out)])
    assert result.exit_code == 130  # Ctrl-C
    # The Markdown and CSV tables were ready, but nothing is written before all are.
    assert not out.exists()


def test_publish_names_an_unreadable_figure(capsys, monkeypatch, tmp_path: Path) -> None:
    kvbench = cli(capsys, monkeypatch)
    write(make_record(), tmp_path / "run")
    (tmp_path / "run" / "memory.png").symlink_to(tmp_path / "gone.png")
    out = tmp_path / "tables"
    code, output = kvbench("publish", tmp_path / "run", "-o", out)
    assert code == 2 and "Traceback" not in output
    assert "memory.png: cannot read figure" in output
    assert not out.exists()


# --- selected metrics, named files, figure, notes ------------------------------------------


def test_publish_picks_rows_names_files_draws_and_appends_notes(tmp_path: Path) -> None:
    for wl, digest in (("wl-a", "aaa"), ("wl-b", "bbb")):
        for engine in ("paged", "vattention"):
            rec = make_record(engine, suite="policies", digest=digest)
            rec = rec.model_copy(update={"workload": rec.workload.model_copy(
                update={"name": wl})})
            rec = changed(rec, kv_map_ops=None if engine == "paged" else 640,
                          peak_page_table_entries=12)
            write(rec, tmp_path / wl)
    notes = tmp_path / "notes.md"
    notes.write_text("## Findings\n\nvattention maps pages.\n")
    out = tmp_path / "tables"
    result = CliRunner().invoke(app, [
        "publish", str(tmp_path / "wl-a"), str(tmp_path / "wl-b"), "-o", str(out),
        "--name", "policies", "--figure", "--notes", str(notes),
        "--metrics", "max_concurrent_requests,kv_map_ops,peak_page_table_entries",
    ], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "policies.csv", "policies.html", "policies.md", "policies.png"]
    md = (out / "policies.md").read_text()
    # One suite on two workloads: a section each.
    assert "## policies: wl-a, tiny" in md and "## policies: wl-b, tiny" in md
    section = md[md.index("## policies: wl-a"):md.index("## policies: wl-b")]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows] == [
        "| metric", "| status", "| max concurrent requests", "| page map operations",
        "| peak page-table entries"]
    assert "| page map operations | - | 640 |" in section
    assert md.rstrip().endswith("vattention maps pages.")
    assert (out / "policies.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "vattention maps pages." in (out / "policies.html").read_text()


def test_publish_refuses_unknown_metrics_with_a_hint(tmp_path: Path, capsys) -> None:
    write(make_record(), tmp_path / "run")
    code, out = run_main(capsys, "publish", str(tmp_path / "run"), "-o", str(tmp_path / "t"),
                         "--metrics", "kv_map_opps")
    assert code == 2 and "did you mean kv_map_ops" in out
    assert not (tmp_path / "t").exists()


def test_two_runs_of_the_same_engines_get_distinct_columns(capsys, monkeypatch,
                                                          tmp_path) -> None:
    """Two runs of one suite on one machine: columns, bars and sentences name each run's
    engine by its folder, and each run's command stands on its own line."""
    import kvbench.report.plots as plots
    from helpers import run_cli

    figures = []
    save = plots.save_png
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figures.append(fig) or
                        save(fig, path))

    sim = ["quick-sim", "--num-requests", "6", "--engines", "paged,contiguous"]
    for name, seed in (("first", "1"), ("second", "1")):
        code, text = run_cli(["run", *sim, "--seed", seed, "--out", str(tmp_path / name)],
                             capsys)
        assert code == 0, text
    code, text = run_cli(["publish", str(tmp_path / "first"), str(tmp_path / "second"),
                          "--figure", "-o", str(tmp_path / "pub")], capsys)
    assert code == 0, text
    md = (tmp_path / "pub" / "tables.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| metric |"))
    assert header.count("paged (first)") == 1 and header.count("paged (second)") == 1
    assert "paged and paged" not in md and "contiguous and contiguous" not in md
    commands = [line for line in md.splitlines() if line.startswith("  - ") and "kvbench run"
                in line]
    assert len(commands) == 4 and all(line.count("kvbench run") == 1 for line in commands)
    # The figure has a bar per run, labelled as the columns are: none hides another.
    legend = figures[-1].axes[0].get_legend_handles_labels()[1]
    assert sorted(legend) == ["contiguous (first)", "contiguous (second)", "paged (first)",
                              "paged (second)"]
