"""RunRecord: the JSON file each engine run produces (one per engine), written atomically."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kvbench import __version__
from kvbench.curves import build_curves
from kvbench.errors import InputFileError
from kvbench.fileio import write_text_atomic
from kvbench.harness import EngineRun
from kvbench.leaks import SoakResult
from kvbench.machine import git_commit, machine_info
from kvbench.metrics import device_series, summarize
from kvbench.slo import SLO

SCHEMA_VERSION = 1


class WorkloadInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    digest: str
    source: str
    seed: int
    num_requests: int
    prompt_tokens: int
    output_tokens: int


class RequestRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    n: int = 1
    status: Literal["ok", "rejected", "unfinished"]
    queue_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0
    output_digest: str | None = None
    reason: str | None = None


class TelemetryInfo(BaseModel):
    """Which probes measured (``probes``: name -> "ok" or "unavailable: why"), facts they
    report once (e.g. device total memory), and which reading ``peak_device_bytes`` and
    ``device_growth_pct`` use."""

    model_config = ConfigDict(extra="forbid")
    probes: dict[str, str]
    facts: dict[str, Any] = {}
    device_memory: str | None = None


class RunRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    kvbench_version: str
    git_commit: str | None
    created_utc: str
    machine: dict[str, Any]
    command: str
    suite: str
    workload: WorkloadInfo
    engine: str
    engine_config: dict[str, Any]
    model: dict[str, Any]
    device: str
    clock: str
    status: Literal["ok", "interrupted", "failed"]
    error: str | None = None
    slo: SLO | None = None
    telemetry: TelemetryInfo | None = None
    soak: SoakResult | None = None
    summary: dict[str, Any]
    curves: dict[str, list[float]]
    requests: list[RequestRow]

    def write(self, path: str | Path) -> Path:
        return write_text_atomic(path, self.model_dump_json(indent=1) + "\n")


def _since(t: float | None, arrival_s: float) -> float | None:
    """Milliseconds from arrival to ``t``."""
    return None if t is None else (t - arrival_s) * 1000.0


def request_rows(run: EngineRun) -> list[RequestRow]:
    rows = []
    for t in run.timings.values():
        r = t.request
        out = r.output_tokens
        tpot = None
        if t.finish_s is not None and t.first_token_s is not None and out > 1:
            tpot = (t.finish_s - t.first_token_s) / (out - 1)
        rows.append(
            RequestRow(
                id=r.id,
                arrival_s=r.arrival_s,
                prompt_tokens=r.prompt_tokens,
                output_tokens=out,
                n=r.n,
                status=t.status,  # type: ignore[arg-type]
                queue_ms=_since(t.first_scheduled_s, r.arrival_s),
                ttft_ms=_since(t.first_token_s, r.arrival_s),
                tpot_ms=None if tpot is None else tpot * 1000.0,
                e2el_ms=_since(t.finish_s, r.arrival_s),
                preemptions=t.preemptions,
                cached_tokens=t.cached_tokens,
                output_digest=t.output_digest,
                reason=t.rejected,
            )
        )
    return rows


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
) -> RunRecord:
    wl = run.workload
    tel = run.telemetry
    telemetry = None
    if tel is not None:
        dev = device_series(run)
        telemetry = TelemetryInfo(
            probes=tel.status, facts=tel.info(), device_memory=dev[0] if dev else None
        )
    return RunRecord(
        kvbench_version=__version__,
        git_commit=git_commit(),
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        machine=machine_info(),
        command=command,
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
        summary=summarize(run, slo) | (soak.summary() if soak is not None else {}),
        curves=build_curves(run.steps, tel),
        requests=request_rows(run),
    )


def load_record(path: str | Path) -> RunRecord:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputFileError(path, f"cannot read run record: {exc}") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise InputFileError(
            path, f"run record schema_version {version!r}; this kvbench reads {SCHEMA_VERSION}"
        )
    try:
        return RunRecord.model_validate(data)
    except ValidationError as exc:
        raise InputFileError(path, f"invalid run record: {exc}") from None
