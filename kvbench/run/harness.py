"""The run harness: feeds a workload's arrivals into an engine under a clock and records
per-request timings, per-step reports and telemetry samples. The same loop drives every
engine.

A run may repeat its workload in ``waves`` through the same engine (soak): wave ``k+1``'s
arrivals start once wave ``k`` has drained, and the memory left after each drain is kept.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvbench.engines.base import DeviceMemory, Engine, KVStats, StepReport
from kvbench.engines.builtin.engine import BuiltinEngine
from kvbench.engines.kv.modality import MODALITIES
from kvbench.engines.sim.device_memory import DeviceOutOfMemory
from kvbench.engines.sim.replay import (
    COLUMNS,
    Arrivals,
    EventReplay,
    StepBlock,
    event_replay,
    replay_blocker,
)
from kvbench.run.clocks import Clock, VirtualClock
from kvbench.run.columns import Column, column_of
from kvbench.run.gaps import GapLog
from kvbench.run.signals import allow_interrupts, interrupt_reason
from kvbench.run.stepstats import Folded, fold
from kvbench.run.telemetry import OK, RssProbe, Telemetry
from kvbench.workloads.model import Request, Workload

RunStatus = Literal["ok", "interrupted", "failed"]

# An engine that neither computes nor finishes anything for this many consecutive steps,
# with nothing left to arrive, is stuck (a scheduler bug); fail rather than spin forever.
_MAX_IDLE_STEPS = 1000
# Warm-up ends when this fraction of the run's requests (at least one) has finished: caches,
# allocator pools and lazily touched pages have settled by then, so memory growth after it
# is what the run itself accumulates.
WARMUP_FRACTION = 0.1


@dataclass(slots=True)
class RequestTiming:
    """One request's timings: when it was first scheduled, emitted its first token and
    finished; how many output tokens it emitted and the step and time of the last (its
    inter-token gaps go to the step log's :class:`~kvbench.run.gaps.GapLog` as they come, so
    a long replay holds a few numbers per request, not one per token)."""

    request: Request
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0
    last_step: int = -1
    last_token_s: float | None = None
    preemptions: int = 0
    cached_tokens: int | None = 0
    output_digest: str | None = None
    rejected: str | None = None
    error: str | None = None

    @property
    def status(self) -> str:
        if self.rejected is not None:
            return "rejected"
        if self.error is not None:
            return "failed"
        return "ok" if self.finish_s is not None else "unfinished"

    @property
    def output_tokens_emitted(self) -> int:
        return self.tokens

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (finish - first token) / (output - 1), for
        completed requests with more than one output token (``vllm bench serve``'s TPOT)."""
        out = self.request.output_tokens
        if self.finish_s is None or self.first_token_s is None or out < 2:
            return None
        return (self.finish_s - self.first_token_s) / (out - 1)


def _float_column() -> Column:
    return Column(np.float64)


@dataclass(slots=True)
class StepLog:
    """Per-step columns (time is the step's end in the clock's seconds), each a
    :class:`~kvbench.run.columns.Column`."""

    t_s: Column = field(default_factory=_float_column)
    dt_s: Column = field(default_factory=_float_column)
    num_tokens: Column = field(default_factory=Column)
    running: Column = field(default_factory=Column)
    waiting: Column = field(default_factory=Column)
    preempted: Column = field(default_factory=Column)
    kv_capacity_bytes: Column = field(default_factory=Column)
    kv_reserved_bytes: Column = field(default_factory=Column)
    kv_used_bytes: Column = field(default_factory=Column)
    kv_reserved_ahead_bytes: Column = field(default_factory=Column)
    kv_free_bytes: Column = field(default_factory=Column)
    kv_largest_free_bytes: Column = field(default_factory=Column)
    kv_shared_bytes: Column = field(default_factory=Column)
    prefix_hit_tokens: Column = field(default_factory=Column)
    block_allocs: Column = field(default_factory=Column)
    block_frees: Column = field(default_factory=Column)
    kv_copied_bytes: Column = field(default_factory=Column)
    page_table_entries: Column = field(default_factory=Column)
    # Admission refusals by the KV manager (KVStats.refused_*): 0 in steps without one.
    kv_refused_bytes: Column = field(default_factory=Column)
    kv_refused_free_bytes: Column = field(default_factory=Column)
    kv_refused_largest_free_bytes: Column = field(default_factory=Column)
    # Encoder outputs kept for reuse (KVStats.encoder_cache_bytes), and per page class of a
    # modality-aware pool ``<class>_<reserved|used|capacity>_bytes``.
    kv_encoder_cache_bytes: Column = field(default_factory=Column)
    kv_class_bytes: dict[str, Column] = field(default_factory=dict)
    # Used KV bytes by the modality of the tokens held (``text``, ``image``, ``audio``; None
    # in steps where the engine cannot attribute them), and the facts of where each
    # modality is stored (KVStats.modalities without the per-step counts).
    kv_modality_bytes: dict[str, Column] = field(default_factory=dict)
    kv_modalities: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The requests' inter-token gaps, by step (ITL).
    gaps: GapLog = field(default_factory=GapLog)
    # Modelled device memory at each step's peak (engines that model it: the simulator),
    # one column per DeviceMemory component, summed over the tensor-parallel ranks.
    device: dict[str, Column] = field(default_factory=dict)
    device_ranks: int = 1
    # The oldest steps of a long replay, folded out of the columns (kvbench.run.stepstats):
    # the columns then hold the steps from ``len(self) - len(self.t_s)`` on.
    folded: Folded | None = None

    def __len__(self) -> int:
        return len(self.t_s) + (self.folded.steps if self.folded is not None else 0)


@dataclass(slots=True)
class WaveEnd:
    """What stayed after a wave drained: the KV snapshot and the latest probe readings."""

    step: int
    t_s: float
    kv: KVStats | None
    memory: dict[str, int]


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
    telemetry: Telemetry | None = None
    warmup_step: int | None = None  # the step at whose end warm-up was over
    waves: int = 1
    wave_ends: list[WaveEnd] = field(default_factory=list)
    step_wall_s: float = 0.0  # wall time of steps incl. their logging, excl. idle waits
    telemetry_wall_s: float = 0.0  # of which: step logging and probe sampling
    # The modelled device ran out of memory (the run failed there, or never started).
    out_of_memory: DeviceOutOfMemory | None = None
    # A cluster's per-replica log (kvbench.engines.cluster.engine.ClusterLog); None for one engine.
    cluster: Any = None
    # Decode fast-forward: "on" (runs of decode-only steps taken in one go), "off" (asked
    # for step by step) or why the engine cannot; and the steps it took in bulk.
    fast_forward: str = "off"
    fast_forward_steps: int = 0
    # The output-agreement check of a reduced-precision KV run (kvbench.run.quality's
    # QualityResult), set by the caller that made it; None where none was considered.
    quality: Any = None
    # Inter-token gaps of requests whose engine stamps token times, by request id, until it
    # completes (then they join the step log's gaps).
    stamped_gaps: dict[str, list[float]] = field(default_factory=dict)
    # On the wall clock: the machine while the engine ran (a results.schema.MachineState),
    # and the CPU seconds of this process's run loop where they are the engine's own (not
    # a served engine's client).
    machine_state: Any = None
    engine_cpu_s: float | None = None


def wave_requests(workload: Workload, wave: int, waves: int, start_s: float) -> list[Request]:
    """The workload's requests as wave ``wave`` of ``waves`` sends them: arrivals shifted to
    ``start_s`` and, when there are several waves, ids made unique per wave."""
    if waves == 1:
        return workload.requests
    return [
        dataclasses.replace(r, id=f"w{wave}:{r.id}", arrival_s=start_s + r.arrival_s)
        for r in workload.requests
    ]


# Called as an engine's requests end: requests done, and the simulated seconds elapsed (None
# on the wall clock, where the caller's own clock says the same).
OnProgress = Callable[[int, float | None], None]


def _with_clock(on_progress: OnProgress | None, clock: Clock) -> Callable[[int], None] | None:
    if on_progress is None:
        return None
    if isinstance(clock, VirtualClock):
        return lambda done: on_progress(done, clock.now())
    return lambda done: on_progress(done, None)


def run_engine(
    engine: Engine,
    workload: Workload,
    clock: Clock,
    on_progress: OnProgress | None = None,
    *,
    telemetry: Telemetry | None = None,
    waves: int = 1,
    max_concurrency: int | None = None,
    fast_forward: bool = True,
) -> EngineRun:
    """Drive ``engine`` through ``workload`` (``waves`` times in a row). Never raises for
    engine failures or Ctrl-C: the returned run carries ``status`` and ``error``; the caller
    decides what follows. ``telemetry`` defaults to process RSS only.

    With ``max_concurrency``, at most that many requests are in flight: a request arriving
    while the limit is reached waits client-side and is sent when one finishes, and its
    latencies count from sending, as ``vllm bench serve --max-concurrency`` measures them
    (its record's ``arrival_s`` is the send time).

    With ``fast_forward``, a simulated engine under the virtual clock takes each run of
    decode-only steps between events in one go (:func:`_fast_forward`): the same steps,
    logged and timed exactly as one at a time."""
    if waves < 1:
        raise ValueError(f"waves must be at least 1, got {waves}")
    progress = _with_clock(on_progress, clock)
    tel = telemetry if telemetry is not None else Telemetry([RssProbe()], {"rss": OK})
    timings = {
        r.id: RequestTiming(r)
        for k in range(waves)
        for r in wave_requests(workload, k, waves, 0.0)
    }
    steps = StepLog()
    run = EngineRun(engine.name, workload, clock.name, timings, steps, telemetry=tel, waves=waves)
    warmup_done = max(1, math.ceil(WARMUP_FRACTION * len(timings)))
    # An engine of many engines (a cluster) fast-forwards inside its own steps.
    inside = getattr(engine, "fast_forward_inside", None)
    # It must know when requests come: one wave, sent as they arrive.
    ff = (_fast_forward_mode(engine, clock, waves == 1 and max_concurrency is None)
          if fast_forward else None)
    run.fast_forward = "off" if not fast_forward else "on" if ff is None else ff
    replay: EventReplay | None = None
    if (fast_forward and inside is None and isinstance(clock, VirtualClock)
            and replay_blocker(engine, workload.requests) is None):
        replay = event_replay(engine, clock.cost, workload.requests,  # type: ignore[arg-type]
                              waves)
        run.fast_forward = "on"
    bulk = fast_forward and ff is None and inside is None and replay is None
    # A cluster's steps in which only replicas' decode runs go on, taken in one call.
    quiet = getattr(engine, "quiet_steps", None) if fast_forward and ff is None else None
    # A long simulated run's oldest steps are folded into the metrics' reductions as it
    # goes (kvbench.run.stepstats), at the same steps whichever way it is stepped; a
    # cluster's per-replica log keeps every step.
    foldable = inside is None and isinstance(clock, VirtualClock)
    done = idle = in_flight = 0
    limit = max_concurrency or len(timings) + 1
    # A simulated run makes many small objects, so the collector runs often, and each of its
    # full passes would walk every object the process held before the run (the workload's,
    # torch's): those are set aside for the run (one such pass took 0.15 s of a Mooncake
    # replay taking 0.2 s contiguous). Objects the run makes are collected as ever.
    frozen = isinstance(clock, VirtualClock) and gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    wall0 = time.perf_counter()
    clock.start()
    try:
        # Interrupts raise here only: outside, while a caller holds them back
        # (kvbench.run.signals), they wait for the next block that turns them into a record.
        with allow_interrupts():
            for wave in range(waves):
                requests = wave_requests(workload, wave, waves, clock.now() if wave else 0.0)
                for r in requests:
                    timings[r.id].request = r
                n, idx = len(requests), 0
                if replay is not None:
                    arrivals = Arrivals(requests, limit, send_late=max_concurrency is not None)
                    done = _replay_wave(run, replay, clock, arrivals,  # type: ignore[arg-type]
                                        done, warmup_done, progress)
                    idx = n
                while idx < n or engine.has_unfinished():
                    if foldable:
                        fold(steps, run.warmup_step)
                    now = clock.now()
                    while idx < n and requests[idx].arrival_s <= now and in_flight < limit:
                        request = requests[idx]
                        if max_concurrency is not None and request.arrival_s < now:
                            request = dataclasses.replace(request, arrival_s=now)
                            timings[request.id].request = request
                        engine.add(request)
                        in_flight += 1
                        idx += 1
                    if not engine.has_unfinished():
                        clock.wait_until(requests[idx].arrival_s)
                        continue
                    if bulk:
                        # Steps until the next arrival the harness would add (none while the
                        # concurrency limit holds it back).
                        due = requests[idx].arrival_s if idx < n and in_flight < limit else math.inf
                        w0 = time.perf_counter()
                        taken = _fast_forward(run, engine, clock, due)  # type: ignore[arg-type]
                        if taken:
                            idle = 0
                            _taken_in_bulk(run, tel, w0)
                            continue
                    if quiet is not None:
                        due = requests[idx].arrival_s if idx < n and in_flight < limit else math.inf
                        w0 = time.perf_counter()
                        block = quiet(due)
                        if block is not None:
                            _log_quiet(run, block, clock)
                            idle = 0
                            _taken_in_bulk(run, tel, w0)
                            continue
                    w0 = time.perf_counter()
                    t0 = clock.now()
                    report = engine.step()
                    clock.after_step(report)
                    t1 = clock.now()
                    ended = _record_requests(run, report, t0, t1, clock)
                    in_flight -= ended
                    w1 = time.perf_counter()
                    _log_step(run, report, t0, t1)
                    step = len(steps) - 1
                    crossed = done < warmup_done <= done + ended
                    if crossed or w1 >= tel.next_due_s:
                        tel.sample(step, w1, force=crossed)
                        if crossed:
                            run.warmup_step = step
                    done += ended
                    w2 = time.perf_counter()
                    run.step_wall_s += w2 - w0
                    run.telemetry_wall_s += w2 - w1
                    if progress is not None:
                        progress(done)
                    # A live server's stalls are bounded by the engine's request timeouts; its
                    # steps only observe, so an empty one is no sign of a stuck scheduler.
                    stalled = report.batch.num_tokens == 0 and report.stamps is None
                    if stalled and not report.finished and idx >= n:
                        idle += 1
                        if idle >= _MAX_IDLE_STEPS:
                            raise RuntimeError(
                                f"engine {engine.name!r} made no progress for {idle} steps "
                                f"({report.num_waiting} waiting, {report.num_running} running)"
                            )
                    else:
                        idle = 0
                if foldable:
                    fold(steps, run.warmup_step)
                if steps.t_s:
                    tel.sample(len(steps) - 1, time.perf_counter(), force=True)
                    run.wave_ends.append(
                        WaveEnd(len(steps) - 1, steps.t_s[-1], run.last_kv, tel.latest())
                    )
    except KeyboardInterrupt as exc:
        run.status, run.error = "interrupted", interrupt_reason(exc)
    except DeviceOutOfMemory as exc:
        # What the engine would meet on that device: the run's outcome, not a crash.
        run.status, run.error, run.out_of_memory = "failed", f"step {len(steps)}: {exc}", exc
    except Exception as exc:
        run.status = "failed"
        run.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
    finally:
        if inside is not None:
            run.fast_forward_steps = getattr(engine, "fast_forward_steps", 0)
        run.duration_s = clock.now()
        run.wall_time_s = time.perf_counter() - wall0
        if frozen:
            gc.unfreeze()
        if steps.t_s and run.status != "ok":
            # The end-of-run reading a drained wave would have taken.
            tel.sample(len(steps) - 1, time.perf_counter(), force=True)
        try:
            engine.close()
        except Exception as exc:
            if run.status == "ok":
                run.status, run.error = "failed", f"close() failed: {exc}"
        tel.close()
    if run.status == "ok" and (nothing := _nothing_completed(run.timings)) is not None:
        run.status, run.error = "failed", nothing
    return run


def _nothing_completed(timings: dict[str, RequestTiming]) -> str | None:
    """Why a run none of whose requests completed, though some were tried, is failed."""
    failed = [t for t in timings.values() if t.status == "failed"]
    if not failed or any(t.status == "ok" for t in timings.values()):
        return None
    rejected = sum(t.status == "rejected" for t in timings.values())
    sent = f" sent ({rejected} more rejected)" if rejected else ""
    return f"all {len(failed)} requests{sent} failed; the first, {failed[0].request.id}: " \
        f"{failed[0].error}"


def _taken_in_bulk(run: EngineRun, tel: Telemetry, w0: float) -> None:
    """After steps taken in one call, begun at wall time ``w0``: a telemetry reading if one is
    due, and their wall time."""
    w1 = time.perf_counter()
    if w1 >= tel.next_due_s:
        tel.sample(len(run.steps) - 1, w1)
    run.step_wall_s += time.perf_counter() - w0


def _fast_forward_mode(engine: Engine, clock: Clock, arrivals_known: bool) -> str | None:
    """None when ``engine`` can take decode steps in bulk under ``clock``; else why not.
    An engine that fast-forwards inside its own steps (a cluster) is turned on here."""
    if not isinstance(clock, VirtualClock):
        return "unsupported: the wall clock times every step"
    inside = getattr(engine, "fast_forward_inside", None)
    if inside is not None:
        reason = inside(arrivals_known)
        return None if reason is None else f"unsupported: {reason}"
    blocker = getattr(engine, "fast_forward_blocker", None)
    if blocker is None:
        return "unsupported: the engine steps one at a time"
    reason = blocker()
    return None if reason is None else f"unsupported: {reason}"


# StepLog columns of the KVStats fields a step reports.
_KV_LOG = {
    "kv_capacity_bytes": "capacity_bytes", "kv_reserved_bytes": "reserved_bytes",
    "kv_used_bytes": "used_bytes", "kv_reserved_ahead_bytes": "reserved_ahead_bytes",
    "kv_free_bytes": "free_bytes", "kv_largest_free_bytes": "largest_free_bytes",
    "kv_shared_bytes": "shared_bytes", "prefix_hit_tokens": "prefix_hit_tokens",
    "block_allocs": "block_allocs", "block_frees": "block_frees",
    "kv_copied_bytes": "copied_bytes", "page_table_entries": "page_table_entries",
    "kv_refused_bytes": "refused_bytes", "kv_refused_free_bytes": "refused_free_bytes",
    "kv_refused_largest_free_bytes": "refused_largest_free_bytes",
}


def _fast_forward(run: EngineRun, engine: BuiltinEngine, clock: VirtualClock,
                  due_s: float) -> int:
    """Take the engine's next run of decode-only steps in one go, ending at the step after
    which ``due_s`` (the next arrival) has come; returns the steps taken (0: the next step
    runs on its own). Each step's time is the cost model's for its batch, accumulated one
    step after another, so clock times, step logs and token times equal step-by-step
    replay's bit for bit."""
    plan = engine.plan_decode()
    if plan is None:
        return 0
    dts = clock.cost.decode_step_times(plan.num_seqs, plan.context, plan.pairs)
    if dts is None:
        return 0
    t_start = clock.now()
    ends = np.cumsum(np.concatenate(([t_start], dts)))
    k = plan.max_steps
    if due_s != math.inf:
        # The first step ending at or after the arrival is the last one before it is added.
        k = min(k, int(np.searchsorted(ends[1:], due_s, side="left")) + 1)
    out = engine.advance_decode(k)
    if out is None:
        return 0
    k = out.steps
    t1 = ends[1 : k + 1]
    s = run.steps
    s.t_s.extend(t1)
    s.dt_s.extend(t1 - ends[:k])
    s.num_tokens.repeat(plan.num_seqs, k)
    s.running.repeat(out.num_running, k)
    s.waiting.repeat(out.num_waiting, k)
    s.preempted.repeat(0, k)
    for column, name in _KV_LOG.items():
        getattr(s, column).extend(out.kv[name])
    for m in MODALITIES:
        column_of(s.kv_modality_bytes, m).extend(out.kv[f"modality:{m}"])
    _modality_facts(s, out.last_kv)
    # Decode steps encode nothing: the encoder outputs held are the modelled device's.
    encoder = out.device.get("encoder") if out.device else None
    if encoder is not None:
        s.kv_encoder_cache_bytes.extend(encoder)
    else:
        s.kv_encoder_cache_bytes.repeat(out.last_kv.encoder_cache_bytes, k)
    if out.device:
        s.device_ranks = out.device_ranks
        for name, values in out.device.items():
            column_of(s.device, name).extend(values)
    run.last_kv = out.last_kv
    timings, gaps = run.timings, s.gaps
    first = len(s) - k
    on = 0
    for rid, count in out.tokens.items():
        on += follows(timings[rid], first, k, count, float(t1[0]), float(t1[-1]), gaps)
    gaps.add(first, first + 1, on)
    gaps.add(first + 1, first + k, len(out.tokens))
    clock.advance_to(float(t1[-1]))
    run.fast_forward_steps += k
    return k


def _replay_wave(run: EngineRun, replay: EventReplay, clock: VirtualClock, arrivals: Arrivals,
                 done: int, warmup_done: int, on_progress: Callable[[int], None] | None) -> int:
    """Drive one wave through an event replay, block by block, logging each as the harness
    logs steps taken one at a time; returns the requests ended so far."""
    tel = run.telemetry
    assert tel is not None
    while arrivals.idx < len(arrivals.requests) or replay.has_unfinished():
        w0 = time.perf_counter()
        block = replay.advance(clock.now(), arrivals)
        w1 = time.perf_counter()
        ended = _log_block(run, block, clock)
        last = len(run.steps) - 1
        if done < warmup_done <= done + ended:
            run.warmup_step = _crossing(block, warmup_done - done)
            tel.sample(run.warmup_step, w1, force=True)
        if last >= 0 and w1 >= tel.next_due_s:
            tel.sample(last, w1)
        done += ended
        fold(run.steps, run.warmup_step)
        w2 = time.perf_counter()
        run.step_wall_s += w2 - w0
        run.telemetry_wall_s += w2 - w1
        if on_progress is not None:
            on_progress(done)
        if block.error is not None:
            raise block.error
    return done


def _block_columns(s: StepLog) -> list[Column]:
    """The step log's columns in the order of a replayed step's values
    (:data:`~kvbench.engines.sim.replay.COLUMNS`)."""
    kv = {field: column for column, field in _KV_LOG.items()}
    kv["encoder_cache_bytes"] = "kv_encoder_cache_bytes"
    out = []
    for name in COLUMNS:
        group, _, key = name.partition(":")
        if group == "modality":
            out.append(column_of(s.kv_modality_bytes, key))
        elif group == "device":
            out.append(column_of(s.device, key))
        else:
            out.append(getattr(s, kv.get(name, name)))
    return out


def _log_block(run: EngineRun, block: StepBlock, clock: VirtualClock) -> int:
    """Log the steps of an event replay's ``block`` as :func:`_log_step` and
    :func:`_record_requests` log them one at a time; returns the requests that ended."""
    s = run.steps
    if block.first_step != len(s):
        raise RuntimeError(f"replayed steps start at {block.first_step}, the log at {len(s)}")
    if block.steps:
        for column, name in zip(_block_columns(s), COLUMNS, strict=True):
            column.extend(block.columns[name])
    timings = run.timings
    for request in block.sent:
        # Sent later than it arrived (the concurrency limit held it): its record says when.
        timings[request.id].request = request
    for rid, t in block.scheduled:
        timings[rid].first_scheduled_s = t
    if block.runs:
        t = block.columns["t_s"]
        first, gaps = block.first_step, s.gaps
        starts, stops = [], []
        for rid, start, stop in block.runs:
            k = stop - start
            on = follows(timings[rid], start, k, 1, float(t[start - first]),
                         float(t[stop - 1 - first]), gaps)
            starts.append(start + 1 - on)
            stops.append(stop)
        gaps.add_many(np.asarray(starts), np.asarray(stops))
    for rid, t in block.first_tokens:
        timings[rid].first_token_s = t
    for rid in block.preempted:
        timings[rid].preemptions += 1
    for fin, t in block.finished:
        timing = timings[fin.request_id]
        if fin.rejected is not None:
            timing.rejected = fin.rejected
            continue
        timing.finish_s = t
        timing.output_digest = fin.output_digest
        timing.cached_tokens = fin.cached_tokens
    if block.last_kv is not None:
        run.last_kv = block.last_kv
        _modality_facts(s, block.last_kv)
    s.device_ranks = block.device_ranks
    run.fast_forward_steps += block.bulk_steps
    clock.advance_to(block.t_end)
    return sum(count for _, count in block.ended)


def _crossing(block: StepBlock, remaining: int) -> int:
    """The step of ``block`` in which ``remaining`` more requests have ended."""
    for step, count in block.ended:
        remaining -= count
        if remaining <= 0:
            return step
    raise AssertionError("the block ends fewer requests")


def _log_quiet(run: EngineRun, block: Any, clock: Clock) -> None:
    """Log a cluster's quiet steps (:meth:`ClusterEngine.quiet_steps`) as :func:`_log_step`
    and :func:`_record_requests` log them one at a time, the clock advanced by each step's
    elapsed time in turn."""
    s = run.steps
    t = clock.now()
    ends: list[float] = []
    for elapsed in block.elapsed_s:
        t1 = t + elapsed
        s.dt_s.append(t1 - t)
        ends.append(t1)
        t = t1
    k = len(ends)
    s.t_s.extend(ends)
    s.num_tokens.extend(block.num_tokens)
    s.running.extend(block.running)
    s.waiting.extend(block.waiting)
    s.preempted.repeat(0, k)
    columns = dict(zip(block.kv_fields, zip(*block.kv, strict=True), strict=True))
    for column, name in _KV_LOG.items():
        getattr(s, column).extend(columns[name])
    s.kv_encoder_cache_bytes.extend(columns["encoder_cache_bytes"])
    # A cluster's KV is not split by modality (its KVStats.modalities is None).
    for m in MODALITIES:
        column_of(s.kv_modality_bytes, m).repeat(None, k)
    run.last_kv = KVStats(**dict(zip(block.kv_fields, block.kv[-1], strict=True)))
    s.device_ranks = block.device_ranks
    for name, values in zip(DeviceMemory.COMPONENTS, zip(*block.device, strict=True),
                            strict=True):
        column_of(s.device, name).extend(values)
    timings, gaps = run.timings, s.gaps
    for step, (tokens, end) in enumerate(zip(block.tokens, ends, strict=True), len(s) - k):
        on = 0
        for rid, count in tokens.items():
            on += follows(timings[rid], step, 1, count, end, end, gaps)
        gaps.add(step, step + 1, on)
    clock.advance_to(t)


def follows(timing: RequestTiming, start: int, steps: int, count: int, first_s: float,
            last_s: float, gaps: GapLog) -> bool:
    """Take ``count`` of ``timing``'s output tokens in each of ``steps`` steps from ``start``
    (the first ending at ``first_s``, the last at ``last_s``). Returns whether the first of
    them follows on from its token of the step before, whose gap is that step's length (the
    caller counts it in ``gaps``); a first token after a preemption has its gap kept as a
    value."""
    timing.tokens += steps * count
    last = timing.last_step
    on = last >= 0 and last == start - 1
    if not on and last >= 0 and first_s != timing.last_token_s:
        gaps.samples.append(first_s - timing.last_token_s)  # type: ignore[operator]
    timing.last_step = start + steps - 1
    timing.last_token_s = last_s
    return on


def _record_requests(
    run: EngineRun, report: StepReport, t0: float, t1: float, clock: Clock
) -> int:
    """Fold one step's tokens and completions into the request timings, at the step's end
    time or, when the engine stamped them, at their own times; returns the number of
    requests that ended."""
    timings = run.timings
    stamps = report.stamps
    if stamps is not None:
        for rid, t in stamps.sent.items():
            # Sent later than it arrived (the client was busy): its record says when.
            timing = timings[rid]
            timing.request = dataclasses.replace(timing.request, arrival_s=clock.at_perf(t))
    for rid in report.scheduled_first:
        timings[rid].first_scheduled_s = t0
    # The step about to be logged (at t1): its index in the step log.
    step = len(run.steps)
    gaps = run.steps.gaps
    on = 0
    for rid, count in report.tokens.items():
        timing = timings[rid]
        if stamps is None:
            on += follows(timing, step, 1, count, t1, t1, gaps)
            continue
        # Stamped times: each gap a value of its own, kept until the request completes
        # (only completed requests' gaps count, as ``vllm bench serve`` counts them).
        held = run.stamped_gaps.setdefault(rid, [])
        for t in stamps.tokens[rid]:
            at = clock.at_perf(t)
            if timing.last_token_s is not None and at != timing.last_token_s:
                held.append(at - timing.last_token_s)
            timing.last_token_s = at
        timing.tokens += len(stamps.tokens[rid])
    gaps.add(step, step + 1, on)
    for rid in report.first_token:
        timings[rid].first_token_s = (t1 if stamps is None else
                                      clock.at_perf(stamps.tokens[rid][0]))
    for rid in report.preempted_ids:
        timings[rid].preemptions += 1
    for fin in report.finished:
        timing = timings[fin.request_id]
        if fin.rejected is not None:
            timing.rejected = fin.rejected
            continue
        if fin.error is not None:
            timing.error = fin.error
            continue
        timing.finish_s = t1 if stamps is None else clock.at_perf(stamps.finished[fin.request_id])
        gaps.samples += run.stamped_gaps.pop(fin.request_id, ())
        timing.output_digest = fin.output_digest
        timing.cached_tokens = fin.cached_tokens
    return len(report.finished)


def _modality_facts(s: StepLog, kv: KVStats) -> None:
    """Keep where each modality is stored (its class, dtype, bytes per token) from ``kv``."""
    if kv.modalities is not None and not s.kv_modalities:
        s.kv_modalities = {m: {k: v for k, v in f.items() if k not in ("tokens", "used_bytes")}
                           for m, f in kv.modalities.items()}


def _log_step(run: EngineRun, report: StepReport, t0: float, t1: float) -> None:
    """Append the step's queue sizes and KV snapshot to the step log."""
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
        s.kv_capacity_bytes.append(kv.capacity_bytes)
        s.kv_reserved_bytes.append(kv.reserved_bytes)
        s.kv_used_bytes.append(kv.used_bytes)
        s.kv_reserved_ahead_bytes.append(kv.reserved_ahead_bytes)
        s.kv_free_bytes.append(kv.free_bytes)
        s.kv_largest_free_bytes.append(kv.largest_free_bytes)
        s.kv_shared_bytes.append(kv.shared_bytes)
        s.prefix_hit_tokens.append(kv.prefix_hit_tokens)
        s.block_allocs.append(kv.block_allocs)
        s.block_frees.append(kv.block_frees)
        s.kv_copied_bytes.append(kv.copied_bytes)
        s.page_table_entries.append(kv.page_table_entries)
        s.kv_refused_bytes.append(kv.refused_bytes)
        s.kv_refused_free_bytes.append(kv.refused_free_bytes)
        s.kv_refused_largest_free_bytes.append(kv.refused_largest_free_bytes)
        s.kv_encoder_cache_bytes.append(kv.encoder_cache_bytes)
        if kv.classes is not None:
            for name, c in kv.classes.items():
                for key in ("reserved_bytes", "used_bytes", "capacity_bytes"):
                    column_of(s.kv_class_bytes, f"{name}_{key}").append(c[key])
        mods = kv.modalities
        for m in MODALITIES:
            column_of(s.kv_modality_bytes, m).append(
                None if mods is None else mods[m]["used_bytes"])
        _modality_facts(s, kv)
    device = report.device
    if device is not None:
        s.device_ranks = device.tp
        columns = s.device
        for name, value in device.components().items():
            column_of(columns, name).append(value)
