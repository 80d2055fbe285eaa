"""kvbench run's output-agreement check: a reduced-precision KV engine with real compute is
compared with its full-precision reference pass, request by request; the reference is exactly
equivalent for a full-precision policy; simulated and switched-off runs say why not."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from helpers import make_workload
from kvbench.cli.app import app
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.kv.modal import ModalPolicy
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.results.schema import load_record
from kvbench.run.clocks import WallClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine
from kvbench.run.quality import QualityCheck, capture_outputs, check_quality
from kvbench.workloads.io import save_workload
from kvbench.workloads.modalities import image_token_count
from kvbench.workloads.model import Request, Segment


def _workload():
    reqs = []
    for i in range(3):
        size = 168 + 28 * i  # qwen2-vl: one token per 28 x 28 pixels
        image = Segment("image", image_token_count("qwen2-vl", size, size), f"img{i}",
                        height=size, width=size, rule="qwen2-vl")
        segs = (Segment("text", 9 + i, f"t{i}"), image,
                Segment("audio", 25, f"aud{i}", seconds=0.5), Segment("text", 6, f"q{i}"))
        reqs.append(Request(f"r{i}", 0.0, segs, 12))
    reqs.append(Request("text", 0.0, (Segment("text", 30, "only-text"),), 12))
    return make_workload(reqs, "quality")


def _run(tmp_path, engines: str, *extra: str, kv: str = "2MiB"):
    wl = save_workload(_workload(), tmp_path / "wl.jsonl")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "run", "quick-cpu", "--workload", str(wl), "--engines", engines, "--kv-memory", kv,
        "--cpu-threads", "1", *extra, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return {e: load_record(out / f"{e}.json") for e in engines.split(",")}, out


def test_int8_run_records_agreement_per_request(tmp_path) -> None:
    records, out = _run(tmp_path, "modal-int8,paged")
    rec = records["modal-int8"]
    assert rec.quality is not None and rec.quality.ran
    assert rec.quality.below_full_precision == {"image": "int8", "audio": "int8"}
    assert rec.quality.weights == "random(seed=0)"
    rows = rec.requests
    for r in rows:
        assert 0.0 <= r.output_match_rate <= 1.0
        if r.first_divergence is None:
            assert r.output_match_rate == 1.0
        else:
            # Every token before the first divergence matched, that one did not.
            assert r.first_divergence / r.output_tokens <= r.output_match_rate < 1.0
        assert 0.0 <= r.probe_mean_abs_logit_diff <= r.probe_max_abs_logit_diff
    # The text-only request's KV is all full precision: bit-identical.
    text = next(r for r in rows if r.id == "text")
    assert text.output_match_rate == 1.0 and text.probe_max_abs_logit_diff == 0.0
    s = rec.summary
    assert math.isclose(s["mean_output_match_rate"],
                        sum(r.output_match_rate for r in rows) / len(rows))
    assert s["identical_output_fraction"] == sum(r.first_divergence is None
                                                 for r in rows) / len(rows)
    assert s["probe_max_abs_logit_diff"] == max(r.probe_max_abs_logit_diff for r in rows)
    assert 0.0 < s["probe_max_abs_logit_diff"] < 1.0
    # paged stores everything at the model's dtype: not checked, and says so.
    paged = records["paged"]
    assert not paged.quality.ran and "model's dtype" in paged.quality.reason
    assert paged.summary["mean_output_match_rate"] is None
    assert all(r.output_match_rate is None for r in paged.requests)
    summary = (out / "summary.md").read_text()
    assert "Output agreement with full-precision KV" in summary
    assert "modal-int8 (image int8, audio int8): compared with" in summary


def test_full_precision_reference_is_exactly_equivalent() -> None:
    """A policy compared with its own full-precision pass agrees bit for bit: the reference
    pass changes nothing but the KV dtypes."""
    preset = get_preset("tiny")
    settings = EngineSettings(
        preset=preset, device=parse_device("cpu"), kv_bytes=2048 * preset.kv_bytes_per_token,
        block_size=16, prefix_caching=False, scheduler=SchedulerConfig(1024, 8, 64, True))
    policy = ModalPolicy(kv_dtype={"text": "float32", "image": "float32", "audio": "float32"},
                         vision_page_tokens=32)
    config = engine_config("fp32", policy, settings)
    engine = build_engine(config)
    assert engine.below_full_precision() == {}
    capture = capture_outputs(engine)
    wl = _workload()
    run = run_engine(engine, wl, WallClock())
    result = check_quality(QualityCheck(), config, engine, capture, run, wl, WallClock(), None)
    assert result.info.ran
    assert result.summary["mean_output_match_rate"] == 1.0
    assert result.summary["identical_output_fraction"] == 1.0
    assert result.summary["probe_max_abs_logit_diff"] == 0.0
    assert all(r["first_divergence"] is None for r in result.requests.values())
    # The reference of a reduced-precision policy differs from it in the dtypes alone.
    assert NAMED_ENGINES["modal-pages-int8"].full_precision() == NAMED_ENGINES["modal-pages"]
    assert NAMED_ENGINES["paged"].full_precision() is NAMED_ENGINES["paged"]


@pytest.mark.parametrize("extra, kv, reason", [
    (("--device", "sim:a100-80gb", "--model", "llama-3-8b"), "1GiB", "simulated device"),
    (("--no-quality-check",), "2MiB", "switched off"),
])
def test_runs_that_are_not_checked_say_why(tmp_path, extra, kv, reason) -> None:
    records, _ = _run(tmp_path, "modal-int8", *extra, kv=kv)
    rec = records["modal-int8"]
    assert not rec.quality.ran and reason in rec.quality.reason
    assert rec.quality.below_full_precision
    assert rec.summary["mean_output_match_rate"] is None
    assert all(r.output_match_rate is None for r in rec.requests)


def test_an_interrupted_reference_pass_stops_the_run(monkeypatch) -> None:
    import kvbench.run.quality as quality

    preset = get_preset("tiny")
    settings = EngineSettings(
        preset=preset, device=parse_device("cpu"), kv_bytes=2048 * preset.kv_bytes_per_token,
        block_size=16, prefix_caching=False, scheduler=SchedulerConfig(1024, 8, 64, True))
    config = engine_config("int8", NAMED_ENGINES["modal-int8"], settings)
    engine = build_engine(config)
    capture = capture_outputs(engine)
    wl = make_workload([Request("text", 0.0, (Segment("text", 8, "t"),), 2)])
    run = run_engine(engine, wl, WallClock())

    def interrupted(ref_config, workload, clock, max_concurrency, check):
        ref = run_engine(build_engine(ref_config), workload, WallClock())
        ref.status, ref.error = "interrupted", "interrupted (SIGTERM)"
        return quality.QualityRun(ref, {}, quality.Capture(), {})

    monkeypatch.setattr(quality, "run_config_captured", interrupted)
    check = QualityCheck()
    result = check_quality(check, config, engine, capture, run, wl, WallClock(), None)
    assert not result.info.ran and "interrupted (SIGTERM)" in result.info.reason
    assert run.status == "interrupted"
    assert not check.references  # a later run may try again
