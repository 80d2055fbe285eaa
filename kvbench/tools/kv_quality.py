"""What reduced-precision KV costs in output quality, measured: a workload runs on a
full-precision engine and on the engine under test, with the same weights, and each request's
greedy output tokens are compared (match rate, first divergence), as are the logits of every
request's first output token (the probe set: both runs see exactly the same inputs there, so
the difference is the KV precision's alone).

Runs use real compute (the torch executor); the weights are those of the run's settings (a
local safetensors checkpoint directory, else seeded random weights), and every report says
which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbench.engines.config import EngineSection, EngineSettings, engine_config
from kvbench.engines.registry import build_engine
from kvbench.errors import KvbenchError
from kvbench.results.metrics import summarize
from kvbench.run.clocks import WallClock
from kvbench.run.harness import EngineRun, run_engine
from kvbench.workloads.model import Workload


@dataclass(slots=True)
class Capture:
    """Each request's generated tokens (first sample) and first-token logits."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    first_logits: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(slots=True)
class QualityRun:
    run: EngineRun
    summary: dict[str, Any]
    capture: Capture
    describe: dict[str, Any]


def run_captured(name: str, section: EngineSection, settings: EngineSettings,
                 workload: Workload) -> QualityRun:
    """Run ``workload`` on the engine ``section`` with real compute, keeping every request's
    tokens and first-token logits."""
    if settings.device.kind == "sim":
        raise KvbenchError("output agreement needs real compute: use --device cpu or cuda")
    engine = build_engine(engine_config(name, section, settings))
    executor = engine.executor  # type: ignore[attr-defined]
    executor.keep_logits = True
    capture = Capture()
    execute = executor.execute

    def capturing(batch: Any, kv: Any) -> list[int]:
        sampled = execute(batch, kv)
        logits = executor.last_logits
        row = 0
        for item in batch.items:
            if not item.sample:
                continue
            seq = item.seq
            if seq.sample_index == 0:
                rid = seq.request.id
                out = capture.tokens.setdefault(rid, [])
                if len(seq.output_ids) == len(out):  # not a recompute after preemption
                    if not out and logits is not None:
                        capture.first_logits[rid] = logits[row].float().cpu().numpy()
                    out.append(sampled[row])
            row += 1
        return sampled

    executor.execute = capturing
    try:
        run = run_engine(engine, workload, WallClock())
        describe = engine.describe()
    finally:
        engine.close()
    if run.status != "ok":
        raise KvbenchError(f"{name}: the run failed ({run.status}): {run.error}")
    return QualityRun(run, summarize(run), capture, describe)


@dataclass(frozen=True, slots=True)
class Agreement:
    request_id: str
    match_rate: float
    first_divergence: int | None
    max_abs_logit_diff: float | None
    mean_abs_logit_diff: float | None


def agreement(reference: Capture, test: Capture) -> list[Agreement]:
    """Per request of ``reference``: the share of output positions where ``test`` produced
    the same token, the first position where it did not (None: never), and the max and mean
    absolute difference of the first-token logits."""
    out = []
    for rid, ref in reference.tokens.items():
        got = test.tokens.get(rid, [])
        n = max(len(ref), 1)
        same = [a == b for a, b in zip(ref, got, strict=False)]
        first = next((i for i, s in enumerate(same) if not s), None)
        if first is None and len(got) != len(ref):
            first = min(len(got), len(ref))
        a, b = reference.first_logits.get(rid), test.first_logits.get(rid)
        diff = None if a is None or b is None else np.abs(a - b)
        out.append(Agreement(
            rid, sum(same) / n, first,
            None if diff is None else float(diff.max()),
            None if diff is None else float(diff.mean()),
        ))
    return out


def summarize_agreement(rows: list[Agreement]) -> dict[str, Any]:
    """Workload-level figures: mean match rate, requests identical throughout, earliest and
    median first divergence, and the probe logits' max / mean absolute difference."""
    if not rows:
        return {}
    div = [r.first_divergence for r in rows if r.first_divergence is not None]
    maxes = [r.max_abs_logit_diff for r in rows if r.max_abs_logit_diff is not None]
    means = [r.mean_abs_logit_diff for r in rows if r.mean_abs_logit_diff is not None]
    return {
        "requests": len(rows),
        "mean_match_rate": float(np.mean([r.match_rate for r in rows])),
        "identical_requests": sum(r.first_divergence is None for r in rows),
        "first_divergence_min": min(div) if div else None,
        "first_divergence_median": float(np.median(div)) if div else None,
        "probe_max_abs_logit_diff": max(maxes) if maxes else None,
        "probe_mean_abs_logit_diff": float(np.mean(means)) if means else None,
    }


def weights_used(describe: dict[str, Any]) -> str:
    """Which weights a run used: the checkpoint directory, or random(seed=N)."""
    return str(describe.get("executor", {}).get("weights"))
