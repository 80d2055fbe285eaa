"""Building a run record from what the harness collected."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from kvbench import __version__
from kvbench.results.curves import build_curves
from kvbench.results.machine import git_commit, machine_info
from kvbench.results.metrics import MODELLED_DEVICE_CURVE, device_series, summarize
from kvbench.results.paths import redact_home
from kvbench.results.runlog import EngineRun, RequestTiming
from kvbench.results.schema import (
    QualityInfo,
    RequestRows,
    RunRecord,
    SoakResult,
    TelemetryInfo,
    WorkloadInfo,
)
from kvbench.results.slo import SLO

# Summary metrics of output agreement (the run's quality check), None where not checked.
QUALITY_METRICS = ("mean_output_match_rate", "identical_output_fraction",
                   "min_first_divergence", "probe_max_abs_logit_diff",
                   "probe_mean_abs_logit_diff")


@dataclass(frozen=True, slots=True)
class QualityResult:
    """A run's output agreement with its full-precision reference: what the record's
    ``quality`` says, each request's figures (by id: :class:`RequestRow` fields) and the
    summary metrics (:data:`QUALITY_METRICS`)."""

    info: QualityInfo
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        return {name: self.summary.get(name) for name in QUALITY_METRICS}


def _since(t: float | None, arrival_s: float) -> float | None:
    """Milliseconds from arrival to ``t``."""
    return None if t is None else (t - arrival_s) * 1000.0


def request_rows(run: EngineRun, quality: QualityResult | None = None) -> RequestRows:
    """The run's request rows, made from its timings when read."""
    timings = list(run.timings.values())
    agreement = quality.requests if quality is not None else {}

    def fields(start: int, stop: int) -> list[dict[str, Any]]:
        return [_fields(t, agreement.get(t.request.id)) for t in timings[start:stop]]

    return RequestRows(len(timings), fields)


_CHECKS = dict.fromkeys(("output_match_rate", "first_divergence", "probe_max_abs_logit_diff",
                         "probe_mean_abs_logit_diff"))


def _fields(t: RequestTiming, agreement: dict[str, Any] | None) -> dict[str, Any]:
    """A :class:`RequestRow`'s fields, in its order."""
    r = t.request
    tpot = t.tpot_s
    return {
        "id": r.id,
        "arrival_s": r.arrival_s,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "n": r.n,
        "status": t.status,
        "queue_ms": _since(t.first_scheduled_s, r.arrival_s),
        "ttft_ms": _since(t.first_token_s, r.arrival_s),
        "tpot_ms": None if tpot is None else tpot * 1000.0,
        "e2el_ms": _since(t.finish_s, r.arrival_s),
        "preemptions": t.preemptions,
        "cached_tokens": t.cached_tokens,
        "output_digest": t.output_digest,
        "reason": t.rejected if t.rejected is not None else t.error,
        **(_CHECKS | agreement if agreement else _CHECKS),
    }


def build_record(
    run: EngineRun,
    *,
    command: str,
    suite: str,
    engine_config: dict[str, Any],
    model: dict[str, Any],
    device: str,
    slo: SLO | None = None,
    soak: SoakResult | None = None,
    quality: QualityResult | None = None,
    run_id: str | None = None,
) -> RunRecord:
    wl = run.workload
    tel = run.telemetry
    telemetry = None
    if tel is not None:
        dev = device_series(run)
        source = dev[0] if dev else None
        if run.steps.device:
            source = f"modelled: {MODELLED_DEVICE_CURVE}"
        telemetry = TelemetryInfo(probes=tel.status, facts=tel.info(), device_memory=source)
    summary = summarize(run, slo) | (soak.summary() if soak is not None else {})
    summary |= quality.metrics() if quality is not None else dict.fromkeys(QUALITY_METRICS)
    curves = build_curves(run.steps, tel)
    if run.cluster is not None:
        from kvbench.results.cluster import cluster_curves, cluster_summary

        summary |= cluster_summary(run, run.cluster)
        curves |= cluster_curves(run.cluster)
    return RunRecord(
        kvbench_version=__version__,
        git_commit=git_commit(),
        run_id=run_id,
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        machine=machine_info(),
        # The command as typed, but the user's home folder as ~ (records get shared).
        command=redact_home(command),
        suite=suite,
        workload=WorkloadInfo(
            name=wl.name,
            digest=wl.digest,
            source=wl.source,
            seed=wl.seed,
            num_requests=len(wl.requests),
            prompt_tokens=sum(r.prompt_tokens for r in wl.requests),
            output_tokens=sum(r.output_tokens * r.n for r in wl.requests),
        ),
        engine=run.engine_name,
        engine_config=engine_config,
        model=model,
        device=device,
        clock=run.clock,
        status=run.status,
        error=run.error,
        slo=slo,
        telemetry=telemetry,
        soak=soak,
        quality=quality.info if quality is not None else None,
        machine_state=[run.machine_state] if run.machine_state is not None else [],
        warnings=[run.machine_state.noisy] if run.machine_state and run.machine_state.noisy
        else [],
        summary=summary,
        curves=curves,
        requests=request_rows(run, quality),
    )
