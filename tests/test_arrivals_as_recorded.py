"""Traces replay as recorded: a trace with timestamps keeps its arrivals whatever the suite's
request_rate; --request-rate on the command line still re-times; every run says which
arrival process it used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_main import cli

from kvbench.run.overrides import RunFlags, resolve_suite
from kvbench.run.plan import plan_run
from kvbench.workloads.traces import import_trace

FIXTURES = Path(__file__).parent / "fixtures"
AZURE = FIXTURES / "azure_llm_2023_conv_head500.csv"
MOONCAKE = FIXTURES / "mooncake_synthetic_trace_head300.jsonl"
AZURE_LMM = FIXTURES / "azure_lmm_2025_synthetic.csv"
SIM = {"device": "sim:a100-80gb", "engines": "paged"}


def _arrivals_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("arrivals: ")]
    assert len(lines) == 1, out
    return lines[0]


def test_a_trace_run_spans_its_timestamps(capsys, monkeypatch, tmp_path: Path) -> None:
    """The default suite re-times its own workload to all-at-0 s; an azure trace given with
    --workload replays its timestamps instead."""
    trace = import_trace("azure", AZURE, limit=30)
    span_s = trace.requests[-1].arrival_s - trace.requests[0].arrival_s
    assert span_s > 10  # the fixture's first 30 rows spread over seconds
    code, out = cli(capsys, monkeypatch)(
        "run", "--workload", f"azure:{AZURE}", "--num-requests", "30",
        "--device", "sim:a100-80gb", "--engines", "paged,contiguous", "--repeat", "1",
        "--max-model-len", "4096", "--out", tmp_path / "o")
    assert code == 0, out
    assert _arrivals_line(out) == (
        f"arrivals: trace timestamps (30 requests over {span_s:,.1f} s, "
        f"{29 / span_s:.3g} req/s on average)")
    for engine in ("paged", "contiguous"):
        record = json.loads((tmp_path / "o" / f"{engine}.json").read_text())
        assert record["summary"]["duration_s"] >= span_s
        arrivals = [r["arrival_s"] for r in record["requests"]]
        assert arrivals == pytest.approx([r.arrival_s for r in trace.requests])


def test_request_rate_on_the_command_line_still_retimes(capsys, monkeypatch,
                                                        tmp_path: Path) -> None:
    code, out = cli(capsys, monkeypatch)(
        "run", "--workload", f"azure:{AZURE}", "--num-requests", "30", "--request-rate", "100",
        "--device", "sim:a100-80gb", "--engines", "paged", "--repeat", "1",
        "--max-model-len", "4096", "--out", tmp_path / "o")
    assert code == 0, out
    assert _arrivals_line(out).startswith("arrivals: Poisson at 100 req/s (re-timing a trace")
    record = json.loads((tmp_path / "o" / "paged.json").read_text())
    # 30 arrivals at 100 req/s take well under the trace's 20-odd seconds.
    assert max(r["arrival_s"] for r in record["requests"]) < 5


@pytest.mark.parametrize(("kind", "path"), [("mooncake", MOONCAKE), ("azure-lmm", AZURE_LMM)])
def test_every_timestamped_trace_kind_replays(kind: str, path: Path, tmp_path: Path) -> None:
    suite, base = resolve_suite(None, RunFlags(workload=f"{kind}:{path}", num_requests=20,
                                               **SIM))
    assert suite.run.request_rate is None
    plan = plan_run(suite, base, tmp_path / "o", "test", repeats=1)
    trace = import_trace(kind, path, limit=20)
    assert [r.arrival_s for r in plan.workload.requests] == [r.arrival_s for r in trace.requests]
    assert plan.arrivals.startswith("trace timestamps (20 requests over ")


@pytest.mark.parametrize(("rate", "burstiness", "said"), [
    ("inf", None, "all at 0 s (request rate inf) (re-timing a trace"),
    ("2", None, "Poisson at 2 req/s (re-timing a trace"),
    ("2", 0.5, "gamma, burstiness 0.5, at 2 req/s (re-timing a trace"),
])
def test_flags_retime_a_trace(rate: str, burstiness: float | None, said: str,
                              tmp_path: Path) -> None:
    flags = RunFlags(workload=f"mooncake:{MOONCAKE}", num_requests=20,
                     request_rate=float(rate), burstiness=burstiness, **SIM)
    suite, base = resolve_suite(None, flags)
    plan = plan_run(suite, base, tmp_path / "o", "test", repeats=1)
    assert plan.arrivals.startswith(said)
    if rate == "inf":
        assert all(r.arrival_s == 0 for r in plan.workload.requests)


def _suite_file(tmp_path: Path, run_lines: str) -> Path:
    path = tmp_path / "trace-suite.toml"
    path.write_text(
        f'name = "trace-suite"\n[workload]\ntrace = "azure"\npath = "{AZURE}"\n'
        f'num_requests = 20\n[run]\ndevice = "sim:a100-80gb"\nengines = ["paged"]\n'
        f"max_model_len = 4096\n{run_lines}"
    )
    return path


def test_a_suite_naming_its_own_trace_and_rate_keeps_retiming(tmp_path: Path) -> None:
    """Its author chose both: the rate re-times the trace, and the run says so."""
    suite, base = resolve_suite(str(_suite_file(tmp_path, "request_rate = 8\n")), RunFlags())
    plan = plan_run(suite, base, tmp_path / "o", "test", repeats=1)
    assert plan.arrivals.startswith("Poisson at 8 req/s (re-timing a trace")
    suite, base = resolve_suite(str(_suite_file(tmp_path, "")), RunFlags())
    plan = plan_run(suite, base, tmp_path / "o2", "test", repeats=1)
    assert plan.arrivals.startswith("trace timestamps (20 requests over ")


def test_a_workload_without_timestamps_keeps_the_suite_rate(tmp_path: Path) -> None:
    """ShareGPT has no timestamps and presets their own process: the suite's request_rate
    (the default suite's inf) still decides, and the line says so."""
    p = tmp_path / "sharegpt.json"
    p.write_text(json.dumps([{"conversations": [{"from": "human", "value": "x" * 40},
                                                {"from": "gpt", "value": "y" * 40}]}] * 3))
    suite, base = resolve_suite(None, RunFlags(workload=f"sharegpt:{p}", **SIM))
    assert suite.run.request_rate == float("inf")
    plan = plan_run(suite, base, tmp_path / "o", "test", repeats=1)
    assert plan.arrivals == "all at 0 s (request rate inf)"
    suite, base = resolve_suite(None, RunFlags(workload="mixed-text", num_requests=5, **SIM))
    plan = plan_run(suite, base, tmp_path / "o2", "test", repeats=1)
    assert plan.arrivals == "all at 0 s (request rate inf)"
    suite, base = resolve_suite("quick-sim", RunFlags(num_requests=5, **SIM))
    plan = plan_run(suite, base, tmp_path / "o3", "test", repeats=1)
    assert plan.arrivals.startswith("Poisson at 4 req/s (the workload's own; 5 requests over ")


@pytest.mark.parametrize(("args", "message"), [
    (["--workload", "azure:missing.csv"], "missing.csv: no such file"),
    (["--workload", f"azure:{AZURE}", "--request-rate", "0"], "--request-rate 0.0"),
    (["--workload", f"azure:{AZURE}", "--request-rate", "nan"], "--request-rate nan"),
    (["--workload", f"azure:{MOONCAKE}"], str(MOONCAKE)),
])
def test_bad_trace_runs_are_refused_plainly(args: list[str], message: str, capsys, monkeypatch,
                                            tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = cli(capsys, monkeypatch)("run", "--device", "sim:a100-80gb", *args)
    assert code == 2, out
    assert message in out
    assert "Traceback" not in out
