"""Figures: written by `kvbench run` and `kvbench report`, non-empty PNGs; a failing figure
loses no record."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.report.plots import RUN_PLOTS, plot_offload, plot_soak, plot_sweep, write_plots
from kvbench.results.schema import LeakFit, SoakResult, WaveMemory, load_record

RUN_ARGS = [
    "--device", "sim:a100-80gb", "--model", "llama-3-8b", "--workload", "mixed-text",
    "--num-requests", "12", "--kv-memory", "2GiB", "--max-model-len", "4096",
    "--slo", "ttft:500,tpot:50", "--engines", "paged,contiguous", "--kv-offload", "cpu:1GiB",
]
PNG = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 10_000, path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    result = CliRunner().invoke(app, ["run", *RUN_ARGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_run_writes_records_then_figures(run_dir: Path) -> None:
    for name, _ in RUN_PLOTS:
        _assert_png(run_dir / name)
    rec = load_record(run_dir / "paged.json")
    assert rec.slo is not None and rec.slo.ttft_ms == 500
    assert rec.summary["request_goodput"] is not None
    assert rec.telemetry.probes["cuda"].startswith("unavailable")


def test_the_offload_figure_needs_an_engine_with_tiers(run_dir: Path, tmp_path: Path) -> None:
    paged, contiguous = (load_record(run_dir / f"{e}.json") for e in ("paged", "contiguous"))
    assert "offload_cpu_used_bytes" in paged.curves
    assert "offload_cpu_used_bytes" not in contiguous.curves
    assert plot_offload([contiguous], tmp_path / "offload.png") is None
    assert not (tmp_path / "offload.png").exists()


def test_report_combines_run_folders(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(run_dir), str(run_dir), "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    assert "![memory](memory.png)" in text
    # The same run twice: nothing tells the records apart but their position.
    assert "| paged (#2) |" in text and "| paged (#4) |" in text
    for name, _ in RUN_PLOTS:
        _assert_png(out / name)


def test_a_failing_figure_costs_only_itself(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    records = [load_record(run_dir / "paged.json")]

    def broken(records, path):
        raise ValueError("no ink")

    def blank(records, path):
        path.write_bytes(PNG)
        return path

    monkeypatch.setattr("kvbench.report.plots.RUN_PLOTS", (("a.png", blank), ("b.png", broken)))
    written, errors = write_plots(records, tmp_path, extra=[("c.png", blank)])
    assert errors == ["plot b.png failed: ValueError: no ink"]
    assert [p.name for p in written] == ["a.png", "c.png"]


def test_sweep_and_soak_figures(run_dir: Path, tmp_path: Path) -> None:
    base = load_record(run_dir / "paged.json")
    records = []
    for engine in ("paged", "contiguous"):
        for i, gib in enumerate((1, 2, 4)):
            summary = dict(base.summary, kv_capacity_bytes=gib * 2**30,
                           max_concurrent_requests=(i + 1) * (4 if engine == "paged" else 1))
            records.append(base.model_copy(update={"engine": engine, "summary": summary}))
    _assert_png(plot_sweep(records, tmp_path / "sweep.png"))
    fit = LeakFit(bytes_per_wave=2**20, growth_bytes=2**21, growth_pct=100.0,
                  threshold_bytes=None, leak=True)
    soak = SoakResult(
        waves=3, waves_completed=3, noise_pct=10, noise_bytes=2**26,
        per_wave=[WaveMemory(wave=k + 1, t_s=float(k), completed=12,
                             memory={"kv_reserved_bytes": (k + 1) * 2**20, "rss_bytes": 2**28})
                  for k in range(3)],
        fits={"kv_reserved_bytes": fit}, leak_bytes_per_wave={"kv_reserved_bytes": 2**20},
        memory_growth_pct=200.0, leak_detected=True, findings=["kv_reserved grows"],
    )
    _assert_png(plot_soak([base.model_copy(update={"soak": soak})], tmp_path / "soak.png"))


def test_labels_qualify_a_shared_name_by_what_tells_the_records_apart() -> None:
    from record_factory import make_record

    from kvbench.report.labels import engine_labels

    a = make_record("paged")
    b = a.model_copy(update={"device": "sim:h200"})
    c = a.model_copy(update={"device": "sim:h200", "git_commit": "0123456789abcdef"})
    assert engine_labels([a, make_record("contiguous")]) == ["paged", "contiguous"]
    assert engine_labels([a, b]) == [f"paged ({a.device})", "paged (sim:h200)"]
    # No one fact differs between all three: each is named by all that vary.
    assert engine_labels([a, b, c]) == [f"paged ({a.device}, abc)", "paged (sim:h200, abc)",
                                        "paged (sim:h200, 01234567)"]
    assert engine_labels([a, a]) == ["paged (#1)", "paged (#2)"]
    assert engine_labels([a, a], [Path("one"), Path("two")]) == ["paged (one)", "paged (two)"]
