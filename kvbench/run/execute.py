"""Executes a run plan: each engine through the harness, records written as they end."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from kvbench.engines.config import EngineConfig
from kvbench.engines.costmodel import CostModel
from kvbench.engines.device_memory import DeviceOutOfMemory
from kvbench.engines.registry import build_engine
from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.report.plots import write_plots
from kvbench.report.tables import summary_markdown
from kvbench.results.build import QualityResult, build_record
from kvbench.results.repeats import fold_repeats
from kvbench.results.schema import QualityInfo, RunRecord
from kvbench.run.clocks import Clock, VirtualClock, WallClock
from kvbench.run.cluster import build_cluster, cluster_log
from kvbench.run.harness import EngineRun, RequestTiming, RunStatus, StepLog, run_engine
from kvbench.run.machine import machine_info
from kvbench.run.plan import RunPlan
from kvbench.run.quality import (
    QualityCheck,
    below_full_precision,
    capture_outputs,
    check_quality,
    reason_not_checked,
)
from kvbench.run.signals import allow_interrupts, deferred_interrupts, interrupt_reason
from kvbench.run.telemetry import Telemetry
from kvbench.run.threads import ThreadsUsed, set_cpu_threads, torch_threads


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


def _not_run(plan: RunPlan, config: EngineConfig, status: RunStatus, error: str,
             waves: int = 1) -> EngineRun:
    """The run of an engine that never stepped (it failed to start or was never reached)."""
    timings = {r.id: RequestTiming(r) for r in plan.workload.requests}
    run = EngineRun(config.name, plan.workload, plan.clock, timings, StepLog(), waves=waves)
    run.status, run.error = status, error
    return run


def start_and_run(
    plan: RunPlan,
    config: EngineConfig,
    progress: Callable[[int], None] | None,
    waves: int = 1,
    quality: QualityCheck | None = None,
) -> tuple[EngineRun, dict]:
    """Build one engine and drive it through the workload. An engine that fails to start, or
    is interrupted while starting, yields a run with that status (its record is still
    written); a configuration error propagates. On a CPU every engine starts at the plan's
    torch CPU threads; its record's ``engine_config.cpu_threads`` says what it ran at, and a
    run whose count changed fails (its figures would not compare). With ``quality``, a run
    whose KV policy stores tokens below the model's precision is compared with its
    full-precision reference (``run.quality``; :mod:`kvbench.run.quality`)."""
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
    described = {**section, **engine.describe()}
    not_checked = capture = None
    if quality is not None:
        not_checked = reason_not_checked(config, engine, quality.enabled, waves)
        if not_checked is None:
            capture = capture_outputs(engine)
    at_start = torch_threads() if plan.cpu_threads is not None else None
    run = run_engine(
        engine, plan.workload, make_clock(plan), progress,
        telemetry=make_telemetry(plan, config), waves=waves,
        max_concurrency=plan.max_concurrency, fast_forward=plan.suite.run.fast_forward,
    )
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
        quality=run.quality, **extra,
    )


def _write_record(plan: RunPlan, earlier: list[RunRecord], name: str, run: EngineRun,
                  config: dict) -> list[RunRecord]:
    """Write ``name``'s record: ``run``'s folded with its ``earlier`` repeats; returns them
    all."""
    repeats = [*earlier, record_of(plan, run, config)]
    fold_repeats(repeats).write(plan.out_dir / f"{name}.json")
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


def execute_plan(
    plan: RunPlan,
    on_engine: Callable[[str], Callable[[int], None] | None] | None = None,
    *,
    plots: bool = True,
) -> list[RunRecord]:
    """Run every engine in turn, ``plan.repeats`` rounds of all engines (so that slow drift
    hits every engine alike); each record is written as soon as its engine ends, folded over
    its repeats so far. A failed engine does not stop the others and is not repeated. An
    interrupt (Ctrl-C, SIGTERM) stops the run: the current engine's record says where (or,
    when its run had ended, is written as it ran), engines not yet started get interrupted
    records, and the summary is still written."""
    runs: dict[str, list[RunRecord]] = {}
    stopped: str | None = None
    # An interrupt that came after an engine's run ended (while its record was built): the
    # record is written all the same, then the run stops as interrupted.
    late: KeyboardInterrupt | None = None
    quality = QualityCheck(plan.suite.run.quality_check)
    # Interrupts raise only while an engine starts or runs (which record them); one that
    # comes between (an engine set up, a record written) waits until the records are.
    with deferred_interrupts() as held:
        for repeat, (name, engine) in itertools.product(range(plan.repeats), plan.engines):
            if any(r.status != "ok" for r in runs.get(name, [])):
                continue
            label = name if plan.repeats == 1 else f"{name} ({repeat + 1}/{plan.repeats})"
            progress = on_engine(label) if on_engine else None
            run, config = start_and_run(plan, engine, progress, quality=quality)
            earlier = runs.get(name, [])
            try:
                runs[name] = _write_record(plan, earlier, name, run, config)
            except KeyboardInterrupt as exc:
                late = exc
                runs[name] = _write_record(plan, earlier, name, run, config)
            if run.status == "interrupted" or late is not None or held.signum is not None:
                stopped = (run.error if run.status == "interrupted" else
                           interrupt_reason(late) if late is not None else held.reason)
                break
        records = [fold_repeats(rs) for rs in runs.values()]
        if stopped is not None:
            records += record_unstarted(plan, set(runs), f"not started: the run was {stopped}")
        write_text_atomic(plan.out_dir / "summary.md", summary_markdown(records))
    if late is not None:
        raise late
    held.deliver()
    # After the records: a figure that fails to draw costs only itself.
    if plots:
        plan.warnings += write_plots(records, plan.out_dir)[1]
    return records
