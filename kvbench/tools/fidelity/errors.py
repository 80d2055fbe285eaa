"""The error arithmetic of a fidelity check: a simulated run against the real run of the same
requests at the same arrival times.

Relative errors are in percent of the real figure and signed (simulated minus real), so that
a table can say which way the model errs; per-request errors are absolute (APE) and reduced
to their median and p90.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvbench.engines.base import BatchShape
from kvbench.errors import KvbenchError

LATENCIES = ("ttft_ms", "tpot_ms", "e2el_ms")
# Run-level figures compared as simulated vs real (summary keys).
RUN_FIGURES = ("request_throughput", "output_throughput", "mean_concurrent_requests",
               "max_concurrent_requests", "preemptions", "peak_kv_used_bytes")
STEP_KINDS = ("prefill-only", "decode-only", "mixed")


def signed_pct(sim: float, real: float) -> float | None:
    """(sim - real) / real in percent; None where the real figure is zero or missing."""
    if real is None or sim is None or real == 0 or not math.isfinite(real):
        return None
    return 100.0 * (sim - real) / real


def _spread(ape: Sequence[float]) -> dict[str, Any]:
    if not ape:
        return {"n": 0, "median_ape_pct": None, "p90_ape_pct": None}
    a = np.asarray(ape, dtype=np.float64)
    return {"n": len(a), "median_ape_pct": float(np.median(a)),
            "p90_ape_pct": float(np.percentile(a, 90))}


def matched_requests(real: list[dict[str, Any]], sim: list[dict[str, Any]]
                     ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of the real and simulated rows of each request completed in both. The two runs
    must have sent the same requests at the same times; anything else is a setup error."""
    by_id = {r["id"]: r for r in sim}
    if set(by_id) != {r["id"] for r in real}:
        raise KvbenchError("the simulated and real runs hold different requests")
    pairs = []
    for r in real:
        s = by_id[r["id"]]
        if not math.isclose(r["arrival_s"], s["arrival_s"], rel_tol=1e-9, abs_tol=1e-9):
            raise KvbenchError(f"request {r['id']} arrived at {r['arrival_s']} s in the real run "
                               f"and at {s['arrival_s']} s in the simulated one")
        if r["status"] == "ok" and s["status"] == "ok":
            pairs.append((r, s))
    return pairs


def request_errors(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Per latency: the median and p90 of the per-request absolute percentage error, and the
    error of the simulated p50 and p90 against the real ones."""
    out: dict[str, Any] = {}
    for key in LATENCIES:
        both = [(r[key], s[key]) for r, s in pairs
                if r[key] is not None and s[key] is not None and r[key] > 0]
        ape = [abs(s - r) / r * 100 for r, s in both]
        real = [r for r, _ in both]
        sim = [s for _, s in both]
        row = _spread(ape)
        for q in (50, 90):
            rq = float(np.percentile(real, q)) if real else None
            sq = float(np.percentile(sim, q)) if sim else None
            row[f"p{q}"] = {"real": rq, "sim": sq, "error_pct": signed_pct(sq, rq)}
        out[key.removesuffix("_ms")] = row
    return out


def run_errors(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Run-level figures of two record summaries: real, simulated and the signed error."""
    return {key: {"real": real.get(key), "sim": sim.get(key),
                  "error_pct": signed_pct(sim.get(key), real.get(key))}
            for key in RUN_FIGURES}


def step_kind(shape: BatchShape) -> str | None:
    if shape.prefill_tokens and shape.decode_tokens:
        return "mixed"
    if shape.prefill_tokens:
        return "prefill-only"
    if shape.decode_tokens:
        return "decode-only"
    return None


def step_errors(shapes: Iterable[BatchShape], measured_s: Iterable[float],
                predicted_s: Iterable[float]) -> dict[str, Any]:
    """Per step kind: how many steps, the median and p90 absolute percentage error of the
    predicted step time, and the signed error of their total time."""
    ape: dict[str, list[float]] = {k: [] for k in STEP_KINDS}
    total: dict[str, list[float]] = {k: [0.0, 0.0] for k in STEP_KINDS}
    for shape, real, pred in zip(shapes, measured_s, predicted_s, strict=True):
        kind = step_kind(shape)
        if kind is None or real <= 0:
            continue
        ape[kind].append(abs(pred - real) / real * 100)
        total[kind][0] += real
        total[kind][1] += pred
    return {k: {**_spread(ape[k]), "total_error_pct": signed_pct(total[k][1], total[k][0])}
            for k in STEP_KINDS}


def goal_pct(load: float) -> float:
    """The goal for the median per-request error: 10% below saturation, 20% above it."""
    return 10.0 if load < 1.0 else 20.0


def misses(errors: dict[str, Any], load: float) -> dict[str, float]:
    """The latencies whose median per-request error misses the goal at ``load``, and by how
    many percentage points."""
    goal = goal_pct(load)
    return {name: round(row["median_ape_pct"] - goal, 1) for name, row in errors.items()
            if row["median_ape_pct"] is not None and row["median_ape_pct"] > goal}


def _closer(error: float | None, again: float | None) -> float | None:
    return error if again is None or error is None else min(error, again)


def gate_failures(result: dict[str, Any], max_pct: float) -> list[str]:
    """The median per-request errors of the kept structure above ``max_pct`` that are also
    above the machine's own noise at that load (a real run against its repeat): an error
    inside the noise cannot be told from the machine's, so it fails no gate. Where the load
    was repeated, the simulator is judged against the real run it is closer to."""
    failures = []
    for wl in result["workloads"]:
        for lv in wl["levels"]:
            noise = lv.get("noise") or {}
            form = lv["forms"][result["form"]]
            again = form.get("requests_again") or {}
            for name, row in form["requests"].items():
                error = _closer(row["median_ape_pct"],
                                (again.get(name) or {}).get("median_ape_pct"))
                floor = (noise.get(name) or {}).get("median_ape_pct") or 0.0
                if error is not None and error > max(max_pct, floor):
                    failures.append(f"{wl['name']} at {lv['load']:.0%} load: median {name} "
                                    f"error {error:.1f}% (the machine's noise {floor:.1f}%)")
    return failures
