"""Soak waves and leak detection: the leaking engine option is caught, normal engines pass."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from helpers import make_workload, text_request
from kvbench.cli.app import app
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sim.costmodel import CostModel
from kvbench.results.leaks import KV_KIND, analyze_soak, fit_kind, slope_per_wave
from kvbench.results.metrics import summarize
from kvbench.run.clocks import VirtualClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine

WAVES = 4


def _soak(engine: str):
    preset = get_preset("llama-3-8b")
    opts = EngineSettings(
        preset=preset, device=parse_device("sim:a100-80gb"),
        kv_bytes=65536 * preset.kv_bytes_per_token, block_size=16, prefix_caching=True,
        scheduler=SchedulerConfig(2048, 64, 1024, True),
    )
    wl = make_workload(
        [text_request(f"r{i}", 100 + 37 * (i % 5), 8 + 3 * (i % 4), arrival=0.01 * i)
         for i in range(12)]
    )
    clock = VirtualClock(CostModel(preset, opts.device.hardware, opts.device.tp))
    eng = build_engine(engine_config(engine, NAMED_ENGINES[engine], opts))
    return run_engine(eng, wl, clock, waves=WAVES)


@pytest.mark.parametrize("engine", ["paged", "contiguous"])
def test_normal_engines_give_memory_back(engine: str) -> None:
    run = _soak(engine)
    assert run.status == "ok", run.error
    assert len(run.timings) == WAVES * 12
    assert all(t.status == "ok" for t in run.timings.values())
    soak = analyze_soak(run)
    assert soak.waves_completed == WAVES
    assert [w.memory[KV_KIND] for w in soak.per_wave] == [0] * WAVES
    assert [w.completed for w in soak.per_wave] == [12] * WAVES
    assert soak.fits[KV_KIND].bytes_per_wave == 0
    assert "rss_bytes" in soak.fits
    assert not soak.leak_detected and soak.findings == []
    # Waves follow each other: each starts after the previous one drained.
    ends = [w.t_s for w in soak.per_wave]
    assert ends == sorted(ends)
    second = [t.request.arrival_s for rid, t in run.timings.items() if rid.startswith("w1:")]
    assert min(second) >= ends[0]


def test_leaking_engine_is_flagged() -> None:
    run = _soak("paged-leaky")
    assert run.status == "ok", run.error
    soak = analyze_soak(run)
    kept = [w.memory[KV_KIND] for w in soak.per_wave]
    assert kept[0] > 0 and kept == sorted(kept) and kept[-1] > kept[0]
    fit = soak.fits[KV_KIND]
    assert fit.leak and fit.bytes_per_wave > 0
    assert soak.leak_detected
    assert soak.leak_bytes_per_wave[KV_KIND] == fit.bytes_per_wave
    assert soak.memory_growth_pct == pytest.approx(100 * (kept[-1] - kept[0]) / kept[0])
    assert any(f.startswith("kv_reserved grows") for f in soak.findings)
    s = summarize(run)
    assert s["kv_retained_bytes"] == kept[-1]


def test_least_squares_slope_and_noise_rule() -> None:
    assert slope_per_wave([1, 3, 5, 7]) == pytest.approx(2.0)
    assert slope_per_wave([5]) == 0.0
    mib = 2**20
    # Noisy kinds: growth must beat both 10% of the first reading and 64 MiB.
    assert not fit_kind("rss_bytes", [500 * mib, 530 * mib, 540 * mib], 10, 64 * mib).leak
    assert fit_kind("rss_bytes", [500 * mib, 550 * mib, 610 * mib], 10, 64 * mib).leak
    assert not fit_kind("rss_bytes", [100 * mib, 120 * mib, 140 * mib], 10, 64 * mib).leak
    # KV is exact: any growth counts.
    assert fit_kind(KV_KIND, [0, 0, 4096], 10, 64 * mib).leak
    assert fit_kind(KV_KIND, [0, 0, 4096], 10, 64 * mib).growth_pct is None
    assert not fit_kind(KV_KIND, [4096] * 3, 10, 64 * mib).leak


def test_soak_command_writes_records_and_fails_on_leak(tmp_path, monkeypatch) -> None:
    drawn = []  # figures are tested in test_plots; here only that the soak asks for them
    monkeypatch.setattr(
        "kvbench.tools.soak.write_plots",
        lambda records, out_dir, extra=(): (drawn.extend(n for n, _ in extra), ([], []))[1],
    )
    out = tmp_path / "soak"
    result = CliRunner().invoke(app, [
        "soak", "--device", "sim:a100-80gb", "--model", "llama-3-8b", "--workload", "mixed-text",
        "--num-requests", "8", "--kv-memory", "4GiB", "--max-model-len", "4096",
        "--engines", "paged,paged-leaky", "--waves", "3", "--out", str(out),
    ])
    assert result.exit_code == 1, result.output
    assert "leak detected" in result.output and "paged-leaky" in result.output
    paged = json.loads((out / "paged.json").read_text())
    leaky = json.loads((out / "paged-leaky.json").read_text())
    assert paged["soak"]["leak_detected"] is False and paged["summary"]["leak_detected"] is False
    assert leaky["soak"]["leak_detected"] is True
    assert leaky["summary"]["leak_kv_reserved_bytes_per_wave"] > 0
    assert len(leaky["soak"]["per_wave"]) == 3
    assert drawn == ["soak.png"]
    assert "Soak" in (out / "summary.md").read_text()
