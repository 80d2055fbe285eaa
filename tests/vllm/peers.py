"""kvbench's served engine and its peers, measured one after the other on one server.

A peer is a load generator of its own (``vllm bench serve``, GuideLLM, AIPerf) run against
the same vLLM OpenAI server with the same requests: a fixed count of prompts of fixed
length, each forced to the same output length (EOS ignored), sent back to back at a fixed
low concurrency (every request queued at once, at most ``concurrency`` in flight). Latency
is then the server's compute for one or two sequences, not queueing that depends on when
each tool's requests arrive. The tools never run at the same time: each round runs every
tool once, the order reversed every other round (A B, B A, ...), so slow drift of the
machine hits every tool alike, and the first round is a warm-up whose figures are dropped.

Every tool's samples are pooled over the measured rounds, and the same definitions (those of
``vllm bench serve``) are applied to each:

- TTFT: first streamed token - request sent, per request;
- TPOT: (last token - first token) / (output tokens - 1), per request;
- ITL: the gap between consecutive streamed token chunks, every gap of every request.

The peers' medians of these and kvbench's are compared as ratios (kvbench / peer).

The server's pace is not constant: on a small shared machine its own clock of the same
requests (vLLM's ``/metrics`` histograms, read before and after each tool's run) moves by
tens of percent from one round to the next, and every client measures what the server did.
So each tool's figures are also set against the server's clock for its own requests: the
*pace* (the server's mean over kvbench's requests / over the peer's) says how much of a raw
ratio the server made, and the *paced* ratio (each tool's mean over the server's mean for
its requests, kvbench's over the peer's) is the difference between the two clients as
instruments.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from served import (
    BENCH_SERVE,
    BENCH_TIMEOUT_S,
    BLOCK,
    MAX_BATCHED,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NUM_BLOCKS,
    VllmServer,
    get_url,
    write_timed_trace,
)

from kvbench.engines.model.presets import get_preset
from kvbench.results.metrics import itl_samples, latency_samples
from kvbench.run.execute import start_and_run
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection
from kvbench.workloads.io import save_workload
from kvbench.workloads.model import Request, Segment, Workload

METRICS = ("ttft", "tpot", "itl")
# kvbench reads /metrics once before and once after the requests, none while they run: the
# peers read none, and a reading takes the server tens of ms.
NO_SCRAPES_MS = 3_600_000.0
# Chunk gaps shorter than this are chunks that came together: a decode step of the tiny
# model on a CPU takes several ms.
BURST_GAP_MS = 0.5
# Where the peers' own environments are looked for (one folder each, holding bin/TOOL),
# unless KVBENCH_PEERS_DIR names another; `nox -s vllm` makes them.
PEERS_DIR = Path(__file__).resolve().parents[2] / ".nox" / "peers"
# The server's own clock of the metrics (vLLM v1): TTFT from the request's arrival in the
# API process to its first token there; TPOT and ITL from the engine core's token stamps,
# TPOT with bench serve's definition (decode time / (output tokens - 1)).
SERVER_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}


@dataclass(frozen=True, slots=True)
class PeerWorkload:
    requests: int = 24
    # A prefill of some tens of milliseconds on the tiny model, so that a client's own
    # millisecond or two is a few percent of TTFT, not ten.
    prompt: int = 384
    output: int = 32
    concurrency: int = 1

    def describe(self) -> str:
        return (f"{self.requests} requests of {self.prompt} prompt / {self.output} output "
                f"tokens (EOS ignored), all queued at once, at most {self.concurrency} in "
                "flight")


@dataclass(slots=True)
class Samples:
    """Per-request TTFT and TPOT and per-gap ITL, in milliseconds."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    requests: int = 0
    rounds: list[dict[str, float | None]] = field(default_factory=list)  # their medians
    # The server's histogram sums (ms) and counts over this tool's requests, per metric;
    # None where a round's counts did not match its requests (other traffic, or a server
    # without the histograms).
    server: dict[str, list[float]] | None = field(default_factory=dict)

    def extend(self, other: Samples) -> None:
        self.ttft += other.ttft
        self.tpot += other.tpot
        self.itl += other.itl
        self.requests += other.requests
        self.rounds.append({m: other.median(m) for m in METRICS}
                           | {f"server_{m}": other.server_mean(m) for m in METRICS})
        if self.server is None or other.server is None:
            self.server = None
            return
        for m, (total, count) in other.server.items():
            acc = self.server.setdefault(m, [0.0, 0.0])
            acc[0] += total
            acc[1] += count

    def server_mean(self, metric: str) -> float | None:
        """The server's mean of ``metric`` over this tool's requests, in ms."""
        total, count = (self.server or {}).get(metric, (0.0, 0.0))
        return total / count if count else None

    def clocked_by(self, before: dict[str, list[float]], after: dict[str, list[float]]
                   ) -> None:
        """The server's histograms between two readings taken around this tool's run.
        Each request adds one TTFT and one TPOT observation; anything else means other
        traffic reached the server, and the server's figures are left out."""
        delta = {m: [after[m][0] - before[m][0], after[m][1] - before[m][1]]
                 for m in METRICS if m in after and m in before}
        if any(delta.get(m, [0, 0])[1] != self.requests for m in ("ttft", "tpot")):
            self.server = None
        else:
            self.server = delta

    def mean(self, metric: str) -> float | None:
        values = getattr(self, metric)
        return statistics.fmean(values) if values else None

    def burst_share(self) -> float | None:
        """The share of chunk gaps under ``BURST_GAP_MS``: chunks the server sent together
        (its API process behind its engine core), read together by any client."""
        return sum(g < BURST_GAP_MS for g in self.itl) / len(self.itl) if self.itl else None

    def median(self, metric: str) -> float | None:
        values = getattr(self, metric)
        return statistics.median(values) if values else None

    @classmethod
    def of_requests(cls, ttft_s: list[float], latency_s: list[float], itls_s: list[list[float]],
                    output: int) -> Samples:
        """From per-request TTFT, latency (to the last token) and chunk gaps, in seconds."""
        tpot = [(lat - t) / (output - 1) for t, lat in zip(ttft_s, latency_s, strict=True)]
        return cls([1000 * t for t in ttft_s], [1000 * t for t in tpot],
                   [1000 * g for gaps in itls_s for g in gaps], len(ttft_s))


Tool = Callable[[VllmServer, Path, int], Samples]  # server, a folder, the round


def server_histograms(server: VllmServer) -> dict[str, list[float]]:
    """The server's running sums (ms) and counts of its TTFT, TPOT and ITL histograms."""
    status, body = get_url(server.base_url + "/metrics")
    if status != 200:
        raise RuntimeError(f"the server's /metrics answered HTTP {status}")
    names = {v: k for k, v in SERVER_HISTOGRAMS.items()}
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        metric = names.get(family.name)
        if metric is None:
            continue
        acc = out.setdefault(metric, [0.0, 0.0])
        for sample in family.samples:  # one series per engine: summed
            if sample.name.endswith("_sum"):
                acc[0] += 1000 * sample.value
            elif sample.name.endswith("_count"):
                acc[1] += sample.value
    return out


# -- kvbench ----------------------------------------------------------------------------


def _salt() -> int:
    """A number of this tool's own: the prompts it sends share no block with any other
    tool's or earlier call's on the same server, so none hits the prefix cache."""
    return secrets.randbits(30)


def kvbench_tool(wl: PeerWorkload) -> Tool:
    salt = _salt()

    def run(server: VllmServer, tmp: Path, k: int) -> Samples:
        preset = get_preset("tiny")
        reqs = [Request(f"q{i}", 0.0, (Segment("text", wl.prompt, f"peers/{salt}/{k}/{i}"),),
                        wl.output) for i in range(wl.requests)]
        path = save_workload(Workload(f"peer{k}", reqs, seed=0, source="tests"),
                             tmp / f"kvbench{k}.jsonl")
        suite = Suite(
            name="served-peers",
            workload=WorkloadSection(file=str(path)),
            model=ModelSection(preset="tiny"),
            run=RunSection(
                device="cpu", clock="wall",
                kv_memory=f"{NUM_BLOCKS * BLOCK * preset.kv_bytes_per_token}B",
                block_size=BLOCK, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED,
                max_model_len=MAX_MODEL_LEN, engines=["served"],
                max_concurrency=wl.concurrency,
            ),
            engines={"served": {  # type: ignore[dict-item]
                "kind": "openai", "endpoint": server.endpoint,
                "scrape_interval_ms": NO_SCRAPES_MS,
            }},
        )
        plan = plan_run(suite, None, tmp / f"kvbench{k}", "test")
        [engine] = [e for _, e in plan.engines]
        run_, _ = start_and_run(plan, engine, None)
        if run_.status != "ok":
            raise RuntimeError(f"kvbench's served run failed: {run_.error}")
        s = latency_samples(run_)
        if len(s["ttft"]) != wl.requests:
            raise RuntimeError(f"kvbench completed {len(s['ttft'])} of {wl.requests} requests")
        itl = np.repeat(*itl_samples(run_))
        return Samples([1000 * t for t in s["ttft"]], [1000 * t for t in s["tpot"]],
                       [1000 * t for t in itl], len(s["ttft"]))

    return run


# -- vllm bench serve ---------------------------------------------------------------------


def bench_serve_tool(wl: PeerWorkload) -> Tool:
    salt = _salt()

    def run(server: VllmServer, tmp: Path, k: int) -> Samples:
        # Its prompts' token ids follow from the trace's block numbers.
        trace = write_timed_trace(tmp / f"bench{k}.jsonl", [0.0] * wl.requests, wl.prompt,
                                  wl.output, first_id=salt + 10_000 * k)
        out = tmp / f"bench{k}.json"
        args = [
            "--backend", "openai", "--base-url", server.base_url, "--model", server.model,
            "--dataset-name", "timed_trace", "--dataset-path", str(trace),
            "--timed-trace-chunk-hash-size", "512", "--no-self-timed",
            "--request-rate", "inf", "--max-concurrency", str(wl.concurrency),
            # No start-up test request: the server then sees exactly the 16 of the trace
            # (the test request would put the first one's prompt in the prefix cache).
            "--ready-check-timeout-sec", "0",
            "--num-prompts", str(wl.requests), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent),
            "--result-filename", out.name,
        ]
        _run([sys.executable, "-c", BENCH_SERVE, *args], tmp / f"bench{k}.log",
             "vllm bench serve")
        b = json.loads(out.read_text())
        if b["completed"] != wl.requests or any(n != wl.output for n in b["output_lens"]):
            raise RuntimeError(f"vllm bench serve completed {b['completed']} of {wl.requests} "
                               f"requests, output lengths {sorted(set(b['output_lens']))}")
        return Samples.of_requests(b["ttfts"], b["latencies"], b["itls"], wl.output)

    return run


def _run(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> None:
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                              env={**os.environ, **(env or {})}, timeout=BENCH_TIMEOUT_S,
                              check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n"
                           + log.read_text(errors="replace")[-3000:])


# -- the second peers: GuideLLM and AIPerf ------------------------------------------------


def word_prompts(wl: PeerWorkload, salt: int, k: int, vocab: int) -> list[str]:
    """Prompts for peers that send text: ``wl.prompt`` words ``t<id>`` each, which the
    served model's word-level tokenizer reads as exactly that many tokens. Random ids seeded
    by the tool's salt and the round: no two prompts share a block."""
    rng = np.random.default_rng([salt, k])
    ids = rng.integers(1, vocab, size=(wl.requests, wl.prompt))
    return [" ".join(f"t{i}" for i in row) for row in ids]


def guidellm_tool(wl: PeerWorkload, exe: Path) -> Tool:
    """GuideLLM 0.8: the prompts from a JSON-lines file (``prompt``, ``prompt_tokens_count``,
    ``output_tokens_count``, so that it sets ``max_tokens`` and ``ignore_eos``), the
    completions API, ``concurrency`` streams, a request count. Its records give each
    request's start and first and last token times, not the gaps between chunks: its ITL
    is not compared (what GuideLLM calls ITL is TPOT as defined here)."""
    salt = _salt()

    def run(server: VllmServer, tmp: Path, k: int) -> Samples:
        data = tmp / f"guidellm{k}.jsonl"
        data.write_text("".join(
            json.dumps({"prompt": p, "prompt_tokens_count": wl.prompt,
                        "output_tokens_count": wl.output}) + "\n"
            for p in word_prompts(wl, salt, k, get_preset("tiny").vocab_size)))
        out = tmp / f"guidellm{k}.json"
        _run([str(exe), "run",
              "--backend", f"kind=openai_http,target={server.base_url},model={server.model},"
                           "request_format=/v1/completions",
              "--profile", f"kind=concurrent,streams={wl.concurrency}",
              "--constraint", f"kind=max_requests,count={wl.requests}",
              "--data", f"kind=json_file,path={data}",
              "--output", f"kind=json,path={out}", "--disable-console-interactive"],
             tmp / f"guidellm{k}.log", "guidellm", env=_PEER_ENV, cwd=tmp)
        [bench] = json.loads(out.read_text())["benchmarks"]
        done = bench["requests"]["successful"]
        lengths = sorted({r["output_tokens"] for r in done})
        failed = len(bench["requests"]["errored"]) + len(bench["requests"]["incomplete"])
        what = (f"guidellm completed {len(done)} of {wl.requests} requests "
                f"({failed} errored or cancelled), output lengths {lengths}")
        if lengths != [wl.output] or failed:
            raise RuntimeError(what)
        if len(done) < wl.requests:
            raise CutShort(what)
        ttft, tpot = [], []
        for r in done:
            t = r["info"]["timings"]
            ttft.append(1000 * (t["first_token_iteration"] - t["request_start"]))
            tpot.append(1000 * (t["last_token_iteration"] - t["first_token_iteration"])
                        / (wl.output - 1))
        return Samples(ttft, tpot, [], len(done))

    return run


def aiperf_tool(wl: PeerWorkload, exe: Path) -> Tool:
    """AIPerf 0.13: the prompts from a ``single_turn`` JSON-lines file taken in order, the
    completions API streamed, ``ignore_eos``, ``concurrency`` at once, no /metrics
    readings. Its records hold TTFT, the gap between every two chunks
    (``inter_chunk_latency``) and ``inter_token_latency``, which is TPOT as defined here."""
    salt = _salt()

    def run(server: VllmServer, tmp: Path, k: int) -> Samples:
        data = tmp / f"aiperf{k}.jsonl"
        data.write_text("".join(
            json.dumps({"text": p, "output_length": wl.output}) + "\n"
            for p in word_prompts(wl, salt, k, get_preset("tiny").vocab_size)))
        out = tmp / f"aiperf{k}"
        _run([str(exe), "profile", "--model", server.model, "--url", server.base_url,
              "--endpoint-type", "completions", "--streaming",
              "--concurrency", str(wl.concurrency), "--request-count", str(wl.requests),
              "--input-file", str(data), "--custom-dataset-type", "single_turn",
              "--dataset-sampling-strategy", "sequential", "--extra-inputs", "ignore_eos:true",
              "--tokenizer", server.model, "--no-server-metrics", "--ui-type", "none",
              "--output-artifact-dir", str(out)],
             tmp / f"aiperf{k}.log", "aiperf", env=_PEER_ENV, cwd=tmp)
        rows = [json.loads(line)["metrics"]
                for line in (out / "profile_export.jsonl").read_text().splitlines() if line]
        # The server's count: AIPerf's own re-tokenises the output text.
        lengths = sorted({r["usage_completion_tokens"]["value"] for r in rows})
        if len(rows) != wl.requests or lengths != [wl.output]:
            raise RuntimeError(f"aiperf completed {len(rows)} of {wl.requests} requests, "
                               f"output lengths {lengths}")
        return Samples([r["time_to_first_token"]["value"] for r in rows],
                       [r["inter_token_latency"]["value"] for r in rows],
                       [g for r in rows for g in r["inter_chunk_latency"]["value"]], len(rows))

    return run


# The peers load the tokenizer from the served model's folder; nothing is downloaded.
# (AIPerf's offline mode, HF_HUB_OFFLINE=1, looks a local folder up as a hub repository
# and fails, so it is not set.)
_PEER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PEER_TOOLS = {"guidellm": guidellm_tool, "aiperf": aiperf_tool}


def peer_executable(tool: str) -> Path | None:
    """``tool``'s command in its own environment (KVBENCH_PEERS_DIR or .nox/peers), or on
    PATH; None where it is not installed."""
    base = Path(os.environ.get("KVBENCH_PEERS_DIR", PEERS_DIR))
    exe = base / tool / "bin" / tool
    if exe.exists():
        return exe
    found = shutil.which(tool)
    return Path(found) if found else None


class CutShort(RuntimeError):
    """A peer ended its run early of its own accord: fewer requests done than asked, none
    of them failed or of the wrong length, the tool exiting as if complete. (GuideLLM 0.8.1
    did so on a loaded 2-core machine: a one-stream run stopped after 5 of 16 requests.)
    Its round is run again: what it measured is sound, it is just not the workload."""


CUT_SHORT_RETRIES = 2  # reruns of a round a peer cut short before the test fails


def _one_round(server: VllmServer, folder: Path, tool: Tool, name: str, k: int) -> Samples:
    tries = 0
    while True:
        before = server_histograms(server)
        try:
            samples = tool(server, folder, k)
        except CutShort as e:
            tries += 1
            if tries > CUT_SHORT_RETRIES:
                raise RuntimeError(f"{e}, in each of {tries} tries") from e
            print(f"{name} round {k} run again: {e}")
            continue
        samples.clocked_by(before, server_histograms(server))
        return samples


def interleaved(server: VllmServer, tmp: Path, tools: dict[str, Tool], rounds: int,
                warmup: int = 1) -> dict[str, Samples]:
    """``warmup`` + ``rounds`` rounds, every tool once a round, the order reversed every
    other round; the samples of the measured rounds pooled per tool. A round a peer cut
    short (:class:`CutShort`) is run again, at most ``CUT_SHORT_RETRIES`` times."""
    names = list(tools)
    pooled = {name: Samples() for name in names}
    for k in range(warmup + rounds):
        order = names if k % 2 == 0 else names[::-1]
        for name in order:
            folder = tmp / name.replace(" ", "-")
            folder.mkdir(parents=True, exist_ok=True)
            samples = _one_round(server, folder, tools[name], name, k)
            if k >= warmup:
                pooled[name].extend(samples)
    return pooled


Figure = Callable[["Samples", str], float | None]  # a tool's figure of a metric


def _against_peers(pooled: dict[str, Samples], figure: Figure, ours: str
                   ) -> dict[str, dict[str, float | None]]:
    """kvbench's ``figure`` over each peer's, per metric; None where either is missing or
    the peer's is 0."""
    out: dict[str, dict[str, float | None]] = {}
    for name, s in pooled.items():
        if name == ours:
            continue
        out[name] = {}
        for m in METRICS:
            a, b = figure(pooled[ours], m), figure(s, m)
            out[name][m] = None if a is None or not b else a / b
    return out


def ratios(pooled: dict[str, Samples], ours: str = "kvbench"
           ) -> dict[str, dict[str, float | None]]:
    """kvbench's median over each peer's, per metric (None where the peer does not record
    the metric, or its median is 0: its chunks came in bursts)."""
    return _against_peers(pooled, Samples.median, ours)


def mean_ratios(pooled: dict[str, Samples], ours: str = "kvbench"
                ) -> dict[str, dict[str, float | None]]:
    """kvbench's mean over each peer's, per metric (None where either has no samples)."""
    return _against_peers(pooled, Samples.mean, ours)


def paces(pooled: dict[str, Samples], ours: str = "kvbench"
          ) -> dict[str, dict[str, float | None]]:
    """By the server's own clock, how much slower it served kvbench's requests than each
    peer's, per metric (None where the server's figures are missing for either)."""
    return _against_peers(pooled, Samples.server_mean, ours)


def by_server_clock(s: Samples, metric: str) -> float | None:
    """A tool's mean over the server's mean for the same requests (the server's
    histograms give means)."""
    a, b = s.mean(metric), s.server_mean(metric)
    return None if a is None or not b else a / b


def paced_ratios(pooled: dict[str, Samples], ours: str = "kvbench"
                 ) -> dict[str, dict[str, float | None]]:
    """kvbench against each peer with the server's pace divided out: kvbench's
    :func:`by_server_clock` over the peer's, what differs between the two clients'
    measurements of the same server."""
    return _against_peers(pooled, by_server_clock, ours)


def off_the_clocks(pooled: dict[str, Samples], peer: str, metrics: Iterable[str], tol: float,
                   ours: str = "kvbench") -> dict[str, tuple[float | None, float | None]]:
    """The metrics on which kvbench, as an instrument, agrees neither with the peer nor
    with the server. By the server's clock (:func:`by_server_clock`) the server itself is
    1, and kvbench's figure must lie between 1 and the peer's figure, widened by ``tol``
    on either side (which holds wherever the paced ratio is within ``tol``). A client adds
    its own time to the server's, and a peer whose client was held up (two cores shared
    with the server) adds more: kvbench nearer the server's clock than such a peer is not
    kvbench's error, while kvbench under the server's figure, or over both, is. Gives
    kvbench's and the peer's figures by the server's clock for each metric off (None
    where missing)."""
    off: dict[str, tuple[float | None, float | None]] = {}
    for m in metrics:
        a, b = by_server_clock(pooled[ours], m), by_server_clock(pooled[peer], m)
        if a is None or b is None or not min(1.0, b) * (1 - tol) <= a <= max(1.0, b) * (1 + tol):
            off[m] = (a, b)
    return off
