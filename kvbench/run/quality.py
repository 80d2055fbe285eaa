"""What reduced-precision KV costs in output quality, measured: a workload runs on a
full-precision engine and on the engine under test, with the same weights, and each request's
greedy output tokens are compared (match rate, first divergence), as are the logits of every
request's first output token (the probe set: the first token is the only one whose inputs
both runs share whatever either generated, so its logits differ by the KV precision and by
nothing the other tokens did).

Runs use real compute (the torch executor); the weights are those of the run's settings (a
local safetensors checkpoint directory, else seeded random weights), and every report says
which.

``kvbench run`` checks every engine whose KV policy stores some modality's tokens below the
model's dtype (:func:`reason_not_checked` says when it does not, and why). Its reference is
a separate pass of the same policy with every modality at the model's dtype
(``KVPolicy.full_precision``): same page sizes and pools, KV budget, scheduler, weights,
seed, workload and clock, so the KV precision is the only difference of configuration. A
full-precision engine of another policy in the same run is not used: attention over other
layouts (one flat pool, or the classes merged by log-sum-exp) rounds differently, by
~1e-7 of the logits on the tiny model, which is no precision effect. Where the
reduced-precision pool holds more tokens, admissions and batches can still differ between
the two passes (and under the wall clock, arrivals fall differently): batched float
arithmetic then rounds differently too, at that same ~1e-7 level.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbench.engines.config import EngineConfig, EngineSection, EngineSettings, engine_config
from kvbench.engines.registry import build_engine
from kvbench.errors import KvbenchError
from kvbench.results.build import QualityResult
from kvbench.results.metrics import summarize
from kvbench.results.runlog import EngineRun
from kvbench.results.schema import QualityInfo
from kvbench.run.clocks import Clock, WallClock
from kvbench.run.harness import run_engine
from kvbench.workloads.model import Workload


@dataclass(slots=True)
class Capture:
    """Each request's generated tokens (first sample) and first-token logits."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    first_logits: dict[str, np.ndarray] = field(default_factory=dict)


def capture_outputs(engine: Any) -> Capture:
    """Keep, from now on, every request's generated tokens and first-token logits of a
    built-in engine with real compute (a recompute after preemption is not counted twice)."""
    executor = engine.executor
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
    return capture


@dataclass(slots=True)
class QualityRun:
    run: EngineRun
    summary: dict[str, Any]
    capture: Capture
    describe: dict[str, Any]


def run_config_captured(config: EngineConfig, workload: Workload, clock: Clock,
                        max_concurrency: int | None = None, check: bool = True) -> QualityRun:
    """Run ``workload`` on the engine of ``config`` with real compute, keeping every
    request's tokens and first-token logits; with ``check``, a run that does not end ok
    raises."""
    if config.device.kind == "sim":
        raise KvbenchError("output agreement needs real compute: use --device cpu or cuda")
    engine = build_engine(config)
    capture = capture_outputs(engine)
    try:
        run = run_engine(engine, workload, clock, max_concurrency=max_concurrency)
        describe = engine.describe()
    finally:
        engine.close()
    if check and run.status != "ok":
        raise KvbenchError(f"{config.name}: the run failed ({run.status}): {run.error}")
    return QualityRun(run, summarize(run), capture, describe)


def run_captured(name: str, section: EngineSection, settings: EngineSettings,
                 workload: Workload, clock: Clock | None = None) -> QualityRun:
    """:func:`run_config_captured` of the engine ``section`` under ``settings``, on the wall
    clock unless another is given (the virtual clock: which request meets which cached
    blocks then does not depend on the machine's speed)."""
    config = engine_config(name, section, settings)
    return run_config_captured(config, workload, clock or WallClock())


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


# --- the check of kvbench run ------------------------------------------------------------


def below_full_precision(engine: Any) -> dict[str, str]:
    """Modalities a built-in engine stores below its model's precision: modality -> dtype."""
    return engine.below_full_precision() if hasattr(engine, "below_full_precision") else {}


def reason_not_checked(config: EngineConfig, engine: Any, enabled: bool,
                       waves: int = 1) -> str | None:
    """Why a run's output agreement is not checked, or None when it is."""
    if not hasattr(engine, "below_full_precision"):
        return ("not one built-in engine (a served engine, vLLM or a cluster of replicas): "
                "its KV precision is not kvbench's to vary")
    below = engine.below_full_precision()
    if not below:
        return (f"every token's KV is stored at the model's dtype ({config.preset.dtype}): "
                "nothing below full precision to check")
    if config.device.kind == "sim":
        return "simulated device: no tokens are computed, so there is no output to compare"
    if not enabled:
        return "switched off (--no-quality-check)"
    if waves != 1:
        return "a soak repeats the workload: kvbench run checks output agreement"
    return None


@dataclass(frozen=True, slots=True)
class NoReference:
    """Why a full-precision reference pass gave nothing to compare with."""

    reason: str
    interrupted: bool = False


@dataclass(slots=True)
class QualityCheck:
    """The output-agreement check of one ``kvbench run``: on or off, and the full-precision
    reference passes made so far (one per reference configuration, shared by the engines
    and repeats that have it)."""

    enabled: bool = True
    references: dict[str, QualityRun | NoReference] = field(default_factory=dict)

    def reference(self, config: EngineConfig, workload: Workload, clock: Clock,
                  max_concurrency: int | None) -> QualityRun | NoReference:
        """The full-precision pass of ``config``'s policy (or why it failed)."""
        section = config.section.full_precision()  # type: ignore[attr-defined]
        key = section.model_dump_json()
        if key not in self.references:
            ref = dataclasses.replace(config, name=f"{config.name} (full precision)",
                                      section=section)
            try:
                got = run_config_captured(ref, workload, clock, max_concurrency, check=False)
            except KvbenchError as exc:
                return NoReference(f"the full-precision reference run could not start: {exc}")
            if got.run.status == "interrupted":  # not kept: a later run may try again
                return NoReference(f"the full-precision reference run was {got.run.error}",
                                   interrupted=True)
            self.references[key] = got if got.run.status == "ok" else NoReference(
                f"the full-precision reference run failed: {got.run.error}")
        return self.references[key]


def check_quality(check: QualityCheck, config: EngineConfig, engine: Any, capture: Capture,
                  run: EngineRun, workload: Workload, clock: Clock,
                  max_concurrency: int | None) -> QualityResult:
    """Compare a finished run's captured outputs with its full-precision reference."""
    below = below_full_precision(engine)
    if run.status != "ok":
        return QualityResult(QualityInfo(ran=False, reason=f"the run did not end ok "
                                         f"({run.status})", below_full_precision=below))
    ref = check.reference(config, workload, clock, max_concurrency)
    if isinstance(ref, NoReference):
        if ref.interrupted:
            # Ctrl-C or SIGTERM during the reference pass stops the whole run.
            run.status, run.error = "interrupted", ref.reason
        return QualityResult(QualityInfo(ran=False, reason=ref.reason,
                                         below_full_precision=below))
    weights = weights_used(engine.describe())
    if weights_used(ref.describe) != weights:
        raise KvbenchError(f"{config.name}: the reference pass used other weights "
                           f"({weights_used(ref.describe)}, not {weights})")
    rows = agreement(ref.capture, capture)
    section = config.section.full_precision()  # type: ignore[attr-defined]
    info = QualityInfo(
        ran=True, below_full_precision=below,
        reference=f"{section.label()}: the same policy with every modality's KV at the "
        "model's dtype; same budget, scheduler, weights, seed, workload and clock",
        weights=weights, probe="the logits of each request's first output token",
    )
    per_request = {r.request_id: {
        "output_match_rate": r.match_rate, "first_divergence": r.first_divergence,
        "probe_max_abs_logit_diff": r.max_abs_logit_diff,
        "probe_mean_abs_logit_diff": r.mean_abs_logit_diff,
    } for r in rows}
    a = summarize_agreement(rows)
    summary = {} if not a else {
        "mean_output_match_rate": a["mean_match_rate"],
        "identical_output_fraction": a["identical_requests"] / a["requests"],
        "min_first_divergence": a["first_divergence_min"],
        "probe_max_abs_logit_diff": a["probe_max_abs_logit_diff"],
        "probe_mean_abs_logit_diff": a["probe_mean_abs_logit_diff"],
    }
    return QualityResult(info, per_request, summary)
