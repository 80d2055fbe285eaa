"""The fidelity check's table (Markdown) and figure (simulated against measured latency per
request), both from ``fidelity.json`` alone."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from kvbench.fileio import write_bytes_atomic, write_text_atomic
from kvbench.tools.fidelity.errors import LATENCIES, STEP_KINDS, goal_pct

_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E"}


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.1f}%" if signed else f"{value:.1f}%"


def _num(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(cells) + " |" for cells in rows)]


def _latency_table(wl: dict[str, Any], form: str) -> list[str]:
    head = ["load", "req/s"] + [f"{_NAMES[k.removesuffix('_ms')]} APE median / p90"
                                for k in LATENCIES]
    head += [f"{_NAMES[k.removesuffix('_ms')]} p50 / p90 error" for k in LATENCIES]
    head += ["goal (median)", "real vs real: TTFT / TPOT / E2E APE median"]
    rows = []
    for lv in wl["levels"]:
        e = lv["forms"][form]["requests"]
        cells = [f"{lv['load']:.0%}", f"{lv['rate']:.2f}"]
        cells += [f"{_pct(e[k]['median_ape_pct'])} / {_pct(e[k]['p90_ape_pct'])}" for k in e]
        cells += [f"{_pct(e[k]['p50']['error_pct'], True)} / {_pct(e[k]['p90']['error_pct'], True)}"
                  for k in e]
        missed = lv["misses"]
        cells.append(f"≤ {goal_pct(lv['load']):.0f}%: " + (
            "met" if not missed else "missed by " + ", ".join(
                f"{_NAMES[k]} {v:.1f} points" for k, v in missed.items())))
        noise = lv.get("noise")
        cells.append(" / ".join(_pct(noise[k]["median_ape_pct"]) for k in noise)
                     if noise else "–")
        rows.append(cells)
    return _table(head, rows)


def _run_table(wl: dict[str, Any], form: str) -> list[str]:
    keys = ("request_throughput", "mean_concurrent_requests", "max_concurrent_requests",
            "preemptions", "peak_kv_used_bytes")
    names = ("throughput (req/s)", "mean concurrency", "max concurrency", "preemptions",
             "peak KV used (bytes)")
    head = ["load", *[f"{n}: real → sim" for n in names], "loop's share of a busy cycle"]
    rows = []
    for lv in wl["levels"]:
        r = lv["forms"][form]["run"]
        cells = [f"{lv['load']:.0%}"] + [
            f"{_num(r[k]['real'])} → {_num(r[k]['sim'])} ({_pct(r[k]['error_pct'], True)})"
            for k in keys]
        cells.append(_pct(lv["gap_pct"]))
        rows.append(cells)
    return _table(head, rows)


def _step_table(wl: dict[str, Any], form: str) -> list[str]:
    head = ["load", *[f"{k}: steps, APE median, total error" for k in STEP_KINDS]]
    rows = []
    for lv in wl["levels"]:
        s = lv["forms"][form]["steps"]
        cells = [f"{lv['load']:.0%}"] + [
            f"{s[k]['n']}, {_pct(s[k]['median_ape_pct'])}, {_pct(s[k]['total_error_pct'], True)}"
            for k in STEP_KINDS]
        rows.append(cells)
    return _table(head, rows)


def _form_table(wl: dict[str, Any], forms: list[str]) -> list[str]:
    head = ["load", *[f"{f}: TTFT / TPOT / E2E" for f in forms]]
    rows = []
    for lv in wl["levels"]:
        cells = [f"{lv['load']:.0%}"]
        for f in forms:
            e = lv["forms"][f]["requests"]
            cells.append(" / ".join(_pct(e[k]["median_ape_pct"]) for k in e))
        rows.append(cells)
    return _table(head, rows)


def markdown(result: dict[str, Any], stamp: str, figure: str | None) -> str:
    spec, form = result["spec"], result["form"]
    fit = result["calibration_fit"]
    scores = ", ".join(f"{k} {v:.1f}%" for k, v in fit["score_pct"].items())
    out = [
        f"# Sim-to-real fidelity: {spec['engine']} on {spec['device']}, model {spec['model']}",
        "", stamp, "",
        f"The cost model was fitted on the steps of two real runs of "
        f"`{spec['calibration']}` (every request at once, then Poisson arrivals at the "
        f"throughput that reached); each other workload ran for real and in simulation with "
        f"the fitted profile, at the same arrival times, KV budget ({spec['kv_memory']}), "
        f"block size ({spec['block_size']}) and scheduler settings. Load levels are "
        f"fractions of the capacity a request-rate sweep of the real engine reached.",
        "",
        f"Structure of the step cost kept: **{form}**, the least held-out error on the "
        f"calibration steps averaged over prefill-only, decode-only and mixed steps "
        f"({scores}).",
    ]
    forms = list(fit["score_pct"])
    for wl in result["workloads"]:
        sweep = ", ".join(
            f"{p['rate'] if p['rate'] == 'inf' else format(p['rate'], '.2f')} → "
            f"{p['throughput']:.2f}" for p in wl["sweep"])
        out += ["", f"## {wl['workload']}", "",
                f"Capacity {wl['capacity_req_s']:.2f} req/s (sweep, offered → achieved req/s: "
                f"{sweep}); {spec['num_requests']} requests per run.", "",
                "Per-request absolute percentage error (APE) and the error of the simulated "
                "percentiles; the last column compares the real run with a second real run "
                "of the same load: the machine's own noise.", "", *_latency_table(wl, form), "",
                "Run-level figures:", "", *_run_table(wl, form), "",
                "Step cycle by kind of step (each real step with the run loop's time before "
                "it while requests were pending, against the cost predicted from its shape):",
                "", *_step_table(wl, form), "",
                "Every structure, median per-request APE:", "", *_form_table(wl, forms)]
    if figure:
        out += ["", f"![simulated vs measured TTFT and TPOT per request]({figure})"]
    return "\n".join(out) + "\n"


def figure_png(result: dict[str, Any]) -> bytes:
    """Simulated against measured TTFT and TPOT of every request (the kept structure), one
    colour per run, on log axes with the diagonal."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.6))
    FigureCanvasAgg(fig)
    for ax, key in zip(fig.subplots(1, 2), ("ttft", "tpot"), strict=True):
        lo, hi = float("inf"), 0.0
        for wl in result["workloads"]:
            for lv in wl["levels"]:
                pts = lv["points"][key]
                if not pts:
                    continue
                real, sim = zip(*pts, strict=True)
                ax.scatter(real, sim, s=12, alpha=0.7,
                           label=f"{wl['name']} {lv['load']:.0%}")
                lo, hi = min(lo, *real, *sim), max(hi, *real, *sim)
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured {_NAMES[key]} (ms)")
        ax.set_ylabel(f"simulated {_NAMES[key]} (ms)")
        ax.set_title(f"{_NAMES[key]} per request ({result['form']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write_report(result: dict[str, Any], out: Path, stamp: str) -> Path:
    write_bytes_atomic(out / "fidelity.png", figure_png(result))
    return write_text_atomic(out / "fidelity.md", markdown(result, stamp, "fidelity.png"))
