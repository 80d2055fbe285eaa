"""The paged / vLLM output-throughput ratio of an engine-bound run, from its records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from record_factory import changed, make_record, write

from kvbench.errors import KvbenchError
from kvbench.results.repeats import fold_repeats
from kvbench.tools.engine_ratio import engine_ratio, main


def _repeats(engine: str, throughputs: list[float]):
    rec = make_record(engine, clock="wall")
    rec = rec.model_copy(update={"engine_config": {
        "kind": engine, "cpu_threads": {"requested": 1, "at_start": 1, "at_end": 1}}})
    return fold_repeats([changed(rec, output_throughput=v, duration_s=1000 / v)
                         for v in throughputs])


def test_ratio_per_round_median_and_threads(tmp_path: Path) -> None:
    write(_repeats("paged", [500.0, 300.0, 450.0]), tmp_path)
    write(_repeats("vllm", [400.0, 400.0, 500.0]), tmp_path)
    ratio = engine_ratio(tmp_path)
    assert ratio.per_round == pytest.approx([1.25, 0.75, 0.9])
    assert ratio.median == pytest.approx(0.9)  # of the rounds, not 450 / 400
    assert ratio.threads == {"paged": 1, "vllm": 1}
    assert ratio.missing is None
    assert "0.900x" in ratio.line() and "min 0.750" in ratio.line()


def test_missing_vllm_is_reported_not_a_number(tmp_path: Path, capsys) -> None:
    write(_repeats("paged", [500.0, 300.0, 450.0]), tmp_path)
    ratio = engine_ratio(tmp_path)
    assert ratio.median is None and ratio.per_round == []
    assert "no vllm record" in ratio.missing and "vLLM was not run" in ratio.missing
    assert main([str(tmp_path), "--json", str(tmp_path / "ratio.json")]) == 0
    assert "not measured" in capsys.readouterr().out
    assert json.loads((tmp_path / "ratio.json").read_text())["median"] is None


def test_failed_engine_and_unpaired_repeats_give_no_ratio(tmp_path: Path) -> None:
    write(_repeats("paged", [500.0, 300.0]), tmp_path)
    write(_repeats("vllm", [400.0, 400.0, 500.0]), tmp_path)
    assert "not the rounds of one run" in engine_ratio(tmp_path).missing
    failed = make_record("vllm", clock="wall", status="failed")
    write(failed.model_copy(update={"error": "boom"}), tmp_path)
    assert "vllm did not finish (failed: boom)" in engine_ratio(tmp_path).missing


def test_no_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KvbenchError, match="no such record folder"):
        engine_ratio(tmp_path / "absent")
    assert main([str(tmp_path / "absent")]) == 2


def test_engine_bound_suite_is_offline_at_equal_threads() -> None:
    from kvbench.run.suite import load_suite

    suite, _ = load_suite("engine-bound")
    r, w = suite.run, suite.workload
    assert (w.preset, w.num_requests, suite.model.preset) == ("mixed-text", 64, "tiny")
    assert r.request_rate == float("inf") and r.cpu_threads == 1 and r.block_size == 32
    assert r.kv_memory == "8MiB" and r.engines == ["paged", "contiguous", "vllm"]
