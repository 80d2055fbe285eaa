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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvbench.engines.base import DeviceMemory, Engine, FastPath, KVStats, StepReport
from kvbench.engines.builtin.engine import DecodeSteps
from kvbench.engines.kv.modality import MODALITIES
from kvbench.engines.sim.device_memory import DeviceOutOfMemory
from kvbench.engines.sim.replay import (
    COLUMNS,
    Arrivals,
    EventReplay,
    StepBlock,
)
from kvbench.results.columns import Column, column_of
from kvbench.results.gaps import GapLog
from kvbench.results.runlog import EngineRun, RequestTiming, StepLog, WaveEnd
from kvbench.results.stepstats import fold
from kvbench.run.clocks import Clock, VirtualClock
from kvbench.run.signals import allow_interrupts, interrupt_reason
from kvbench.run.telemetry import OK, RssProbe, Telemetry
from kvbench.workloads.model import Request, Workload

# An engine that neither computes nor finishes anything for this many consecutive steps is
# stuck (a scheduler bug, or leaked KV): it waits for the next request that can be sent, and
# with none left the run fails rather than spin forever.
_MAX_IDLE_STEPS = 1000
# Warm-up ends when this fraction of the run's requests (at least one) has finished: caches,
# allocator pools and lazily touched pages have settled by then, so memory growth after it
# is what the run itself accumulates.
WARMUP_FRACTION = 0.1


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

    With ``fast_forward``, an engine under the virtual clock takes its steps through its
    :meth:`~kvbench.engines.base.Engine.fast_path`, logged as one at a time."""
    if waves < 1:
        raise ValueError(f"waves must be at least 1, got {waves}")
    tel = telemetry if telemetry is not None else Telemetry([RssProbe()], {"rss": OK})
    timings = {r.id: RequestTiming(r)
               for k in range(waves) for r in wave_requests(workload, k, waves, 0.0)}
    run = EngineRun(engine.name, workload, clock.name, timings, StepLog(), telemetry=tel,
                    waves=waves)
    path = _fast_path(engine, workload, clock, fast_forward, waves, max_concurrency)
    run.fast_forward = path.mode
    # A soak's trace would grow with every wave and read as a leak of this process.
    engine.trace_prefix_accesses(waves == 1)
    driver = _Driver(run, tel, engine, clock, path, max_concurrency,
                     _with_clock(on_progress, clock))
    wall0 = time.perf_counter()
    clock.start()
    try:
        # Interrupts raise here only: outside, while a caller holds them back
        # (kvbench.run.signals), they wait for the next block that turns them into a record.
        with allow_interrupts(), _collector_aside(isinstance(clock, VirtualClock)):
            for wave in range(waves):
                driver.wave(wave)
    except KeyboardInterrupt as exc:
        run.status, run.error = "interrupted", interrupt_reason(exc)
    except DeviceOutOfMemory as exc:
        # What the engine would meet on that device: the run's outcome, not a crash.
        run.status, run.error = "failed", f"step {len(run.steps)}: {exc}"
        run.out_of_memory = exc
    except Exception as exc:
        run.status = "failed"
        run.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
    finally:
        _finish(run, engine, clock, path, tel, time.perf_counter() - wall0)
    if run.status == "ok" and (nothing := _nothing_completed(run.timings)) is not None:
        run.status, run.error = "failed", nothing
    return run


def _finish(run: EngineRun, engine: Engine, clock: Clock, path: FastPath, tel: Telemetry,
            wall_s: float) -> None:
    """Close a run however it ended: what its clock and fast path counted, the oracle's
    hit rate, and the engine shut down."""
    if path.counted is not None:
        run.fast_forward_steps = path.counted()
    run.duration_s = clock.now()
    run.wall_time_s = wall_s
    run.offload_stall_s = clock.load_stall_s if isinstance(clock, VirtualClock) else None
    if run.status == "ok":
        run.prefix_oracle = _prefix_oracle(engine)
    _close(run, tel, engine)


def _fast_path(engine: Engine, workload: Workload, clock: Clock, enabled: bool, waves: int,
               max_concurrency: int | None) -> FastPath:
    """How the run takes ``engine``'s steps: the engine's own answer under the virtual clock."""
    if not enabled:
        return FastPath("off")
    if not isinstance(clock, VirtualClock):
        return FastPath("unsupported: the wall clock times every step")
    # Arrivals known ahead: one wave, each request sent as it arrives.
    known = waves == 1 and max_concurrency is None
    return engine.fast_path(clock.cost, workload.requests, waves, known)


@contextmanager
def _collector_aside(simulated: bool) -> Iterator[None]:
    """A simulated run makes many small objects; the collector's full passes would also walk
    every object held before it (the workload's, torch's), so those are set aside."""
    frozen = simulated and gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    try:
        yield
    finally:
        if frozen:
            gc.unfreeze()


def _prefix_oracle(engine: Engine) -> Any:
    """The engine's prefix oracle, or None where it cannot be had: the run stands without it."""
    try:
        return engine.prefix_oracle()
    except (MemoryError, ValueError):
        return None


def _close(run: EngineRun, tel: Telemetry, engine: Engine) -> None:
    """Close the engine and telemetry after a run; a failing close fails a run that was ok."""
    if run.steps.t_s and run.status != "ok":
        # The end-of-run reading a drained wave would have taken.
        tel.sample(len(run.steps) - 1, time.perf_counter(), force=True)
    try:
        engine.close()
    except Exception as exc:
        if run.status == "ok":
            run.status, run.error = "failed", f"close() failed: {exc}"
    tel.close()


class _Driver:
    """Feeds a run's waves into its engine: each request when it arrives (and the concurrency
    limit lets it), steps taken through the engine's fast path or one at a time."""

    def __init__(self, run: EngineRun, tel: Telemetry, engine: Engine, clock: Clock,
                 path: FastPath, max_concurrency: int | None,
                 progress: Callable[[int], None] | None) -> None:
        self.run, self.tel, self.engine, self.clock, self.path = run, tel, engine, clock, path
        self.max_concurrency = max_concurrency
        self.limit = max_concurrency or len(run.timings) + 1
        self.progress = progress
        self.warmup_done = max(1, math.ceil(WARMUP_FRACTION * len(run.timings)))
        # A long simulated run's oldest steps are folded into the metrics' reductions as it
        # goes (kvbench.results.stepstats), at the same steps whichever way it is stepped.
        self.foldable = isinstance(clock, VirtualClock) and not engine.keeps_steps
        self.done = self.idle = self.in_flight = 0

    def wave(self, wave: int) -> None:
        run, clock, steps = self.run, self.clock, self.run.steps
        requests = wave_requests(run.workload, wave, run.waves, clock.now() if wave else 0.0)
        for r in requests:
            run.timings[r.id].request = r
        if self.path.replay is not None:
            arrivals = Arrivals(requests, self.limit, send_late=self.max_concurrency is not None)
            self.done = _replay_wave(run, self.tel, self.path.replay,
                                     clock, arrivals,  # type: ignore[arg-type]
                                     self.done, self.warmup_done, self.progress)
        else:
            self._steps(requests)
        if self.foldable:
            fold(steps, run.warmup_step)
        if steps.t_s:
            self.tel.sample(len(steps) - 1, time.perf_counter(), force=True)
            run.wave_ends.append(
                WaveEnd(len(steps) - 1, steps.t_s[-1], run.last_kv, self.tel.latest()))

    def _steps(self, requests: list[Request]) -> None:
        """Step the engine until the wave's requests have arrived and ended."""
        engine, n, idx = self.engine, len(requests), 0
        while idx < n or engine.has_unfinished():
            if self.foldable:
                fold(self.run.steps, self.run.warmup_step)
            idx = self._admit(requests, idx)
            if not engine.has_unfinished():
                self.clock.wait_until(requests[idx].arrival_s)
                continue
            # The next arrival the driver would add (none while the concurrency limit holds).
            due = requests[idx].arrival_s if idx < n and self.in_flight < self.limit else math.inf
            if self.path.jump is None or not self._jump(due):
                self._step(due)

    def _admit(self, requests: list[Request], idx: int) -> int:
        """Add the requests from ``idx`` that have arrived, as far as the concurrency limit
        lets; returns the index of the next."""
        now = self.clock.now()
        while idx < len(requests) and requests[idx].arrival_s <= now \
                and self.in_flight < self.limit:
            request = requests[idx]
            if self.max_concurrency is not None and request.arrival_s < now:
                request = dataclasses.replace(request, arrival_s=now)
                self.run.timings[request.id].request = request
            self.engine.add(request)
            self.in_flight += 1
            idx += 1
        return idx

    def _jump(self, due_s: float) -> bool:
        """Take the steps the engine's fast path takes in one call; False: none."""
        assert self.path.jump is not None
        w0 = time.perf_counter()
        block = self.path.jump(self.clock.now(), due_s)
        if block is None:
            return False
        if isinstance(block, DecodeSteps):
            _log_decode(self.run, block, self.clock)
        else:
            _log_quiet(self.run, block, self.clock)
        self.idle = 0
        _taken_in_bulk(self.run, self.tel, w0)
        return True

    def _step(self, due_s: float) -> None:
        """Take and log one step; ``due_s``: when the next request can be sent (inf: none
        before one ends)."""
        run, clock, tel = self.run, self.clock, self.tel
        w0 = time.perf_counter()
        t0 = clock.now()
        report = self.engine.step()
        clock.after_step(report)
        t1 = clock.now()
        ended = _record_requests(run, report, t0, t1, clock)
        self.in_flight -= ended
        w1 = time.perf_counter()
        _log_step(run, report, t0, t1)
        step = len(run.steps) - 1
        crossed = self.done < self.warmup_done <= self.done + ended
        if crossed or w1 >= tel.next_due_s:
            tel.sample(step, w1, force=crossed)
            if crossed:
                run.warmup_step = step
        self.done += ended
        w2 = time.perf_counter()
        run.step_wall_s += w2 - w0
        run.telemetry_wall_s += w2 - w1
        if self.progress is not None:
            self.progress(self.done)
        self._watch(report, due_s)

    def _watch(self, report: StepReport, due_s: float) -> None:
        """Wait out, or fail, an engine that is stuck (see ``_MAX_IDLE_STEPS``)."""
        # A live server's stalls are bounded by the engine's request timeouts; its steps only
        # observe, so an empty one is no sign of a stuck scheduler.
        stalled = report.batch.num_tokens == 0 and report.stamps is None
        if not stalled or report.finished:
            self.idle = 0
            return
        self.idle += 1
        if self.idle < _MAX_IDLE_STEPS:
            return
        if due_s < math.inf:
            self.clock.wait_until(due_s)
            self.idle = 0
            return
        raise RuntimeError(
            f"engine {self.engine.name!r} made no progress for {self.idle} steps "
            f"({report.num_waiting} waiting, {report.num_running} running)")


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


def _log_groups(s: StepLog, groups: dict[str, dict[str, Any]]) -> None:
    """Append each kind of layer group's reserved and used bytes and its pool usage, the
    groups of a kind summed (None for a figure not reported now; one first reported now
    reads None at the steps before)."""
    if not groups and not s.kv_groups:
        return  # a pool of one kind of KV: every step of most runs
    totals: dict[str, float] = {}
    for g in groups.values():
        for key in ("reserved_bytes", "used_bytes", "usage"):
            if g.get(key) is not None:
                name = f"{g['kind']}_{key}"
                totals[name] = totals.get(name, 0) + g[key]
    for name in totals.keys() - s.kv_groups.keys():
        column_of(s.kv_groups, name).repeat(None, len(s.kv_used_bytes) - 1)
    for name, column in s.kv_groups.items():
        column.append(totals.get(name))


def _log_tiers(s: StepLog, tiers: dict[str, dict[str, Any]]) -> None:
    """The bytes each offload tier holds at this step (None for a tier a served engine
    did not report now; a tier first reported now reads None at the steps before)."""
    for kind in tiers.keys() - s.offload_bytes.keys():
        column_of(s.offload_bytes, kind).repeat(None, len(s.kv_used_bytes) - 1)
    for kind, column in s.offload_bytes.items():
        tier = tiers.get(kind)
        column.append(None if tier is None else tier.get("used_bytes"))


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


def _log_decode(run: EngineRun, out: DecodeSteps, clock: Clock) -> None:
    """Log a built-in engine's run of decode steps taken in one go
    (:meth:`~kvbench.engines.builtin.engine.BuiltinEngine.jump`) as :func:`_log_step` and
    :func:`_record_requests` log them one at a time."""
    k, ends = out.steps, out.ends
    t1 = ends[1 : k + 1]
    s = run.steps
    s.t_s.extend(t1)
    s.dt_s.extend(t1 - ends[:k])
    s.num_tokens.repeat(sum(out.tokens.values()), k)
    s.running.repeat(out.num_running, k)
    s.waiting.repeat(out.num_waiting, k)
    s.preempted.repeat(0, k)
    for column, name in _KV_LOG.items():
        getattr(s, column).extend(out.kv[name])
    for m in MODALITIES:
        column_of(s.kv_modality_bytes, m).extend(out.kv[f"modality:{m}"])
    for key, values in out.kv.items():
        if key.startswith("offload:"):
            column_of(s.offload_bytes, key.removeprefix("offload:")).extend(values)
        elif key.startswith("class:"):
            column_of(s.kv_class_bytes, key.removeprefix("class:")).extend(values)
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


def _replay_wave(run: EngineRun, tel: Telemetry, replay: EventReplay, clock: VirtualClock,
                 arrivals: Arrivals, done: int, warmup_done: int,
                 on_progress: Callable[[int], None] | None) -> int:
    """Drive one wave through an event replay, block by block, logging each as the harness
    logs steps taken one at a time; returns the requests ended so far."""
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
        logged = len(s.kv_used_bytes)
        for column, name in zip(_block_columns(s), COLUMNS, strict=True):
            column.extend(block.columns[name])
        for kind in block.tiers:
            if kind not in s.offload_bytes:
                column_of(s.offload_bytes, kind).repeat(None, logged)
            s.offload_bytes[kind].extend(block.columns[f"offload:{kind}"])
    for stall in block.stalls:  # one step after another, as the clock adds them
        clock.load_stall_s += stall
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
        _log_groups(s, kv.groups or {})
        _log_tiers(s, kv.offload_tiers or {})
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
