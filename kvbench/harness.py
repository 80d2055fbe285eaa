"""The run harness: feeds a workload's arrivals into an engine under a clock and records
per-request timings and per-step reports. The same loop drives every engine."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import psutil

from kvbench.clocks import Clock
from kvbench.engines.base import Engine, KVStats, StepReport
from kvbench.workloads.model import Request, Workload

RunStatus = Literal["ok", "interrupted", "failed"]

# An engine that neither computes nor finishes anything for this many consecutive steps,
# with nothing left to arrive, is stuck (a scheduler bug); fail rather than spin forever.
_MAX_IDLE_STEPS = 1000
# RSS sampling is rate-limited in wall time so that fast (simulated) steps stay cheap.
_RSS_PERIOD_S = 0.02


@dataclass(slots=True)
class RequestTiming:
    request: Request
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0
    output_digest: str | None = None
    rejected: str | None = None

    @property
    def status(self) -> str:
        if self.rejected is not None:
            return "rejected"
        return "ok" if self.finish_s is not None else "unfinished"

    @property
    def output_tokens_emitted(self) -> int:
        return len(self.token_times_s)


@dataclass(slots=True)
class StepLog:
    """Per-step columns (time is the step's end in the clock's seconds)."""

    t_s: list[float] = field(default_factory=list)
    dt_s: list[float] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    kv_reserved_bytes: list[int | None] = field(default_factory=list)
    kv_used_bytes: list[int | None] = field(default_factory=list)
    kv_free_bytes: list[int | None] = field(default_factory=list)
    kv_largest_free_bytes: list[int | None] = field(default_factory=list)
    kv_shared_bytes: list[int | None] = field(default_factory=list)
    prefix_hit_tokens: list[int | None] = field(default_factory=list)
    block_allocs: list[int | None] = field(default_factory=list)
    block_frees: list[int | None] = field(default_factory=list)
    rss_t_s: list[float] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.t_s)


@dataclass(slots=True)
class EngineRun:
    engine_name: str
    workload: Workload
    clock: str
    timings: dict[str, RequestTiming]
    steps: StepLog
    last_kv: KVStats | None = None
    duration_s: float = 0.0
    wall_time_s: float = 0.0
    status: RunStatus = "ok"
    error: str | None = None


def run_engine(
    engine: Engine,
    workload: Workload,
    clock: Clock,
    on_progress: Callable[[int], None] | None = None,
) -> EngineRun:
    """Drive ``engine`` through ``workload``. Never raises for engine failures or Ctrl-C:
    the returned run carries ``status`` and ``error``; the caller decides what follows."""
    requests = workload.requests
    timings = {r.id: RequestTiming(r) for r in requests}
    steps = StepLog()
    run = EngineRun(engine.name, workload, clock.name, timings, steps)
    proc = psutil.Process()
    n, idx, idle, done = len(requests), 0, 0, 0
    wall0 = time.perf_counter()
    next_rss = 0.0
    clock.start()
    try:
        while idx < n or engine.has_unfinished():
            now = clock.now()
            while idx < n and requests[idx].arrival_s <= now:
                engine.add(requests[idx])
                idx += 1
            if not engine.has_unfinished():
                clock.wait_until(requests[idx].arrival_s)
                continue
            t0 = clock.now()
            report = engine.step()
            clock.after_step(report)
            t1 = clock.now()
            done += _record_step(run, report, t0, t1)
            wall = time.perf_counter()
            if wall >= next_rss:
                next_rss = wall + _RSS_PERIOD_S
                steps.rss_t_s.append(t1)
                steps.rss_bytes.append(proc.memory_info().rss)
            if on_progress is not None:
                on_progress(done)
            if report.batch.num_tokens == 0 and not report.finished and idx >= n:
                idle += 1
                if idle >= _MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"engine {engine.name!r} made no progress for {idle} steps "
                        f"({report.num_waiting} waiting, {report.num_running} running)"
                    )
            else:
                idle = 0
    except KeyboardInterrupt:
        run.status, run.error = "interrupted", "interrupted by the user (Ctrl-C)"
    except Exception as exc:
        run.status = "failed"
        run.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
    finally:
        run.duration_s = clock.now()
        run.wall_time_s = time.perf_counter() - wall0
        try:
            engine.close()
        except Exception as exc:
            if run.status == "ok":
                run.status, run.error = "failed", f"close() failed: {exc}"
    return run


def _record_step(run: EngineRun, report: StepReport, t0: float, t1: float) -> int:
    """Fold one step report into the run; returns the number of requests that ended."""
    timings = run.timings
    for rid in report.scheduled_first:
        timings[rid].first_scheduled_s = t0
    for rid, count in report.tokens.items():
        times = timings[rid].token_times_s
        times.extend([t1] * count)
    for rid in report.first_token:
        timings[rid].first_token_s = t1
    for rid in report.preempted_ids:
        timings[rid].preemptions += 1
    for fin in report.finished:
        timing = timings[fin.request_id]
        if fin.rejected is not None:
            timing.rejected = fin.rejected
            continue
        timing.finish_s = t1
        timing.output_digest = fin.output_digest
        timing.cached_tokens = fin.cached_tokens
    s = run.steps
    s.t_s.append(t1)
    s.dt_s.append(t1 - t0)
    s.num_tokens.append(report.batch.num_tokens)
    s.running.append(report.num_running)
    s.waiting.append(report.num_waiting)
    s.preempted.append(report.num_preempted)
    kv = report.kv
    if kv is not None:
        run.last_kv = kv
        s.kv_reserved_bytes.append(kv.reserved_bytes)
        s.kv_used_bytes.append(kv.used_bytes)
        s.kv_free_bytes.append(kv.free_bytes)
        s.kv_largest_free_bytes.append(kv.largest_free_bytes)
        s.kv_shared_bytes.append(kv.shared_bytes)
        s.prefix_hit_tokens.append(kv.prefix_hit_tokens)
        s.block_allocs.append(kv.block_allocs)
        s.block_frees.append(kv.block_frees)
    return len(report.finished)
