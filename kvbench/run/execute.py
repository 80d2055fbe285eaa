"""Executes a run plan: each engine through the harness, records written as they end."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from kvbench.engines.builtin.engine import BuiltinEngine
from kvbench.engines.cluster.engine import ClusterEngine
from kvbench.engines.config import EngineConfig
from kvbench.engines.registry import build_engine
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.device_memory import DeviceOutOfMemory
from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.report.plots import write_plots
from kvbench.report.tables import summary_markdown
from kvbench.results.build import QualityResult, build_record
from kvbench.results.machine import machine_info
from kvbench.results.manifest import start_manifest
from kvbench.results.repeats import fold_repeats
from kvbench.results.runlog import EngineRun, RequestTiming, RunStatus, StepLog
from kvbench.results.schema import QualityInfo, RunRecord
from kvbench.run.clocks import Clock, VirtualClock, WallClock
from kvbench.run.cluster import cluster_log
from kvbench.run.harness import OnProgress, run_engine
from kvbench.run.isolate import run_isolated
from kvbench.run.machine_state import LoadProbe, noisy_summary
from kvbench.run.plan import RunPlan
from kvbench.run.quality import (
    QualityCheck,
    below_full_precision,
    capture_outputs,
    check_quality,
    reason_not_checked,
)
from kvbench.run.signals import Held, allow_interrupts, deferred_interrupts, interrupt_reason
from kvbench.run.telemetry import Telemetry
from kvbench.run.threads import ThreadsUsed, set_cpu_threads, torch_threads

# An observer put around an engine before it runs (the engine in, the engine to drive out).
Wrap = Callable[[Any], Any]


def make_telemetry(plan: RunPlan, config: EngineConfig) -> Telemetry:
    """The probes of one engine's run: of this process and its device, or of the server a
    served engine drives."""
    # The record's machine identity imports torch; do it before the first engine runs, so
    # that every engine's RSS includes the same libraries.
    machine_info()
    server = config.section.server()
    if server is not None:
        return Telemetry.for_server(server.pid, server.gpu_index)
    return Telemetry.for_device(plan.device.kind, plan.device.torch_device)


def make_clock(plan: RunPlan) -> Clock:
    if plan.clock == "wall":
        return WallClock()
    return VirtualClock(CostModel(plan.preset, plan.device.hardware, plan.device.tp))


def build_cluster(plan: RunPlan, config: EngineConfig) -> ClusterEngine:
    """The replicas of ``config`` behind the suite's router, on one virtual clock."""
    cluster = plan.suite.cluster
    replicas = []
    for _ in range(cluster.num_replicas):
        engine = build_engine(config)
        assert isinstance(engine, BuiltinEngine)
        replicas.append(engine)
    cost = CostModel(plan.preset, plan.device.hardware, plan.device.tp)
    # With a client-side concurrency limit requests are sent later than they arrive: the
    # arrival times would only add events, so the cluster goes without them.
    arrivals = (None if plan.max_concurrency is not None
                else [r.arrival_s for r in plan.workload.requests])
    return ClusterEngine(config.name, replicas, cluster, cost, arrivals)


def _not_run(plan: RunPlan, config: EngineConfig, status: RunStatus, error: str,
             waves: int = 1) -> EngineRun:
    """The run of an engine that never stepped (it failed to start or was never reached)."""
    timings = {r.id: RequestTiming(r) for r in plan.workload.requests}
    run = EngineRun(config.name, plan.workload, plan.clock, timings, StepLog(), waves=waves)
    run.status, run.error = status, error
    return run


def _drive(plan: RunPlan, config: EngineConfig, engine: Any,
           progress: OnProgress | None, waves: int) -> EngineRun:
    """The harness's run of ``engine``; on the wall clock with the machine's state."""
    telemetry = make_telemetry(plan, config)
    probe = LoadProbe() if plan.clock == "wall" else None
    run = run_engine(
        engine, plan.workload, make_clock(plan), progress,
        telemetry=telemetry, waves=waves,
        max_concurrency=plan.max_concurrency, fast_forward=plan.suite.run.fast_forward,
    )
    if probe is not None:
        run.machine_state = state = probe.stop()
        if not config.section.realtime:  # a served engine's CPU time is not in this process
            run.engine_cpu_s = state.user_cpu_s + state.system_cpu_s
    return run


def start_and_run(
    plan: RunPlan,
    config: EngineConfig,
    progress: OnProgress | None,
    waves: int = 1,
    quality: QualityCheck | None = None,
    wrap: Wrap | None = None,
) -> tuple[EngineRun, dict]:
    """Build one engine and drive it through the workload. An engine that fails to start, or
    is interrupted while starting, yields a run with that status (its record is still
    written); a configuration error propagates. On a CPU every engine starts at the plan's
    torch CPU threads; its record's ``engine_config.cpu_threads`` says what it ran at, and a
    run whose count changed fails (its figures would not compare). With ``quality``, a run
    whose KV policy stores tokens below the model's precision is compared with its
    full-precision reference (``run.quality``; :mod:`kvbench.run.quality`). ``wrap``
    puts an observer around the engine before it runs."""
    section = {"kind": config.section.kind, **config.section.model_dump()}
    if plan.cpu_threads is not None:
        # Again before each engine: one that changed the count must not pass it on.
        set_cpu_threads(plan.cpu_threads)
    try:
        active = plan.suite.cluster.active
        with allow_interrupts():
            engine = build_cluster(plan, config) if active else build_engine(config)
    except KvbenchError:
        raise
    except KeyboardInterrupt as exc:
        reason = f"{interrupt_reason(exc)} while the engine was starting"
        return _not_run(plan, config, "interrupted", reason, waves), section
    except DeviceOutOfMemory as exc:
        # As a real engine refuses to start when its pool and profile do not fit.
        run = _not_run(plan, config, "failed", f"engine failed to start: {exc}", waves)
        run.out_of_memory = exc
        return run, section
    except Exception as exc:
        reason = f"engine failed to start: {type(exc).__name__}: {exc}"
        return _not_run(plan, config, "failed", reason, waves), section
    if wrap is not None:
        engine = wrap(engine)
    described = {**section, **engine.describe()}
    not_checked = capture = None
    if quality is not None:
        not_checked = reason_not_checked(config, engine, quality.enabled, waves)
        if not_checked is None:
            capture = capture_outputs(engine)
    at_start = torch_threads() if plan.cpu_threads is not None else None
    run = _drive(plan, config, engine, progress, waves)
    if quality is not None:
        run.quality = (
            QualityResult(QualityInfo(ran=False, reason=not_checked,
                                      below_full_precision=below_full_precision(engine)))
            if capture is None else
            check_quality(quality, config, engine, capture, run, plan.workload,
                          make_clock(plan), plan.max_concurrency))
    run.cluster = cluster_log(engine)
    # How the steps ran: the same records either way, so this is where it shows.
    described["fast_forward"] = {"mode": run.fast_forward, "steps": run.fast_forward_steps}
    if run.steps.kv_modalities:
        # Where each modality's KV was stored (page class, dtype, bytes per token).
        described["kv_modalities"] = run.steps.kv_modalities
    # Facts learned while running (vLLM's kv-equivalent multimodal inputs) complete it.
    described.update((k, v) for k, v in engine.describe().items() if k not in described)
    if at_start is not None:
        used = ThreadsUsed(plan.suite.run.cpu_threads, at_start, torch_threads())
        described["cpu_threads"] = used.to_json()
        unequal = used.unequal(plan.cpu_threads)
        if unequal is not None and run.status == "ok":
            run.status, run.error = "failed", unequal
    return run, described


def record_of(plan: RunPlan, run: EngineRun, config: dict, **extra: Any) -> RunRecord:
    return build_record(
        run, command=plan.command, suite=plan.suite.name, engine_config=config,
        model=plan.preset.to_json(), device=plan.device.label, slo=plan.suite.run.slo,
        quality=run.quality, run_id=plan.run_id, **extra,
    )


def run_one(plan: RunPlan, config: EngineConfig, progress: OnProgress | None,
            quality: QualityCheck, wrap: Wrap | None = None
            ) -> tuple[RunRecord, KeyboardInterrupt | None]:
    """One engine's run, in this process, as its record; and an interrupt that came while
    the record was built (it is built again, whole, before the interrupt goes on)."""
    run, described = start_and_run(plan, config, progress, quality=quality, wrap=wrap)
    try:
        return record_of(plan, run, described), None
    except KeyboardInterrupt as exc:
        return record_of(plan, run, described), exc


def _isolated_one(plan: RunPlan, name: str, progress: OnProgress, quality: bool,
                  wrap: Wrap | None) -> RunRecord:
    """Engine ``name``'s record in the process :func:`run_isolated` started for it."""
    record, _ = run_one(plan, dict(plan.engines)[name], progress, QualityCheck(quality), wrap)
    return record


def round_order(engines: list[tuple[str, EngineConfig]], k: int,
                interleave: bool) -> list[tuple[str, EngineConfig]]:
    """Round ``k``'s engine order: ABC, CBA, BCA, ACB, CAB, BAC, ... when ``interleave``
    (so that drift in the machine's load hits every engine alike), else as given."""
    if not interleave or not engines:
        return engines
    shift = (k // 2) % len(engines)
    order = engines[shift:] + engines[:shift]
    return order[::-1] if k % 2 else order


def _write_record(plan: RunPlan, earlier: list[RunRecord], name: str,
                  record: RunRecord) -> list[RunRecord]:
    """Write ``name``'s record: ``record`` folded with its ``earlier`` repeats; returns them
    all. A write that fails (disk full) stops the run, the records already written kept."""
    repeats = [*earlier, record]
    path = plan.out_dir / f"{name}.json"
    try:
        fold_repeats(repeats).write(path)
    except OSError as exc:
        kept = sorted(p.name for p in plan.out_dir.glob("*.json"))
        raise KvbenchError(
            f"could not write {path} ({exc.strerror or exc}); the run stopped there. Records "
            f"written before it are kept in {plan.out_dir}: {', '.join(kept) or 'none'}"
        ) from None
    return repeats


def record_unstarted(plan: RunPlan, done: set[str], reason: str) -> list[RunRecord]:
    """Records, with ``status`` interrupted and no metrics, of the plan's engines not in
    ``done``: an interrupted run says what it never reached."""
    out = []
    for name, config in plan.engines:
        if name not in done:
            section = {"kind": config.section.kind, **config.section.model_dump()}
            record = record_of(plan, _not_run(plan, config, "interrupted", reason), section)
            record.write(plan.out_dir / f"{name}.json")
            out.append(record)
    return out


def _run_engine(plan: RunPlan, name: str, config: EngineConfig,
                progress: OnProgress | None, quality: QualityCheck,
                held: Held, wrap: Wrap | None) -> tuple[RunRecord, KeyboardInterrupt | None]:
    """One engine's record, from a fresh process when the plan isolates engines."""
    if not plan.isolated:
        return run_one(plan, config, progress, quality, wrap)
    job = partial(_isolated_one, quality=quality.enabled, wrap=wrap)
    got = run_isolated(plan, name, progress, held, job)
    if isinstance(got, str):
        # A process that an interrupt passed on to ended before it could say so itself.
        status: RunStatus = "failed" if held.signum is None else "interrupted"
        reason = got if held.signum is None else f"{held.reason} while the engine started"
        section = {"kind": config.section.kind, **config.section.model_dump()}
        return record_of(plan, _not_run(plan, config, status, reason), section), None
    return got, None


def execute_plan(
    plan: RunPlan,
    on_engine: Callable[[str], OnProgress | None] | None = None,
    *,
    plots: bool = True,
    wrap: Wrap | None = None,
) -> list[RunRecord]:
    """Run every engine, ``plan.repeats`` rounds of all engines, on the wall clock each round
    in another order (:func:`round_order`) and each engine in its own process; each record is
    written as soon as its engine ends, folded over its repeats so far. A failed engine does
    not stop the others and is not repeated. An interrupt (Ctrl-C, SIGTERM) stops the run:
    the current engine's record says where (or, when its run had ended, is written as it
    ran), engines not yet started get interrupted records, and the summary is still
    written. The folder's manifest says which engines finished. ``wrap`` (picklable, for
    an engine in its own process) puts an observer around each engine before it runs."""
    runs: dict[str, list[RunRecord]] = {}
    stopped: str | None = None
    late: KeyboardInterrupt | None = None
    quality = QualityCheck(plan.suite.run.quality_check)
    manifest = start_manifest(plan.out_dir, plan.run_id, plan.command,
                              [n for n, _ in plan.engines])
    interleave = plan.clock == "wall"
    # Interrupts raise only while an engine starts or runs (which record them); one that
    # comes between (an engine set up, a record written) waits until the records are.
    with deferred_interrupts() as held:
        for repeat in range(plan.repeats):
            for name, engine in round_order(plan.engines, repeat, interleave):
                if any(r.status != "ok" for r in runs.get(name, [])):
                    continue
                label = name if plan.repeats == 1 else f"{name} ({repeat + 1}/{plan.repeats})"
                progress = on_engine(label) if on_engine else None
                record, late = _run_engine(plan, name, engine, progress, quality, held, wrap)
                runs[name] = _write_record(plan, runs.get(name, []), name, record)
                if name not in manifest.engines_finished and plan.repeats == repeat + 1:
                    manifest.engines_finished.append(name)
                    manifest.write(plan.out_dir)
                if record.status == "interrupted" or late is not None or held.signum is not None:
                    stopped = (record.error if record.status == "interrupted" else
                               interrupt_reason(late) if late is not None else held.reason)
                    break
            if stopped is not None:
                break
        records = [fold_repeats(runs[n]) for n, _ in plan.engines if n in runs]
        plan.warnings += noisy_summary(records)
        if stopped is not None:
            records += record_unstarted(plan, set(runs), f"not started: the run was {stopped}")
        write_text_atomic(plan.out_dir / "summary.md", summary_markdown(records))
        manifest.finish(plan.out_dir, "interrupted" if stopped is not None else
                        "ok" if all(r.status == "ok" for r in records) else "failed")
    if late is not None:
        raise late
    held.deliver()
    # After the records: a figure that fails to draw costs only itself.
    if plots:
        plan.warnings += write_plots(records, plan.out_dir)[1]
    return records
