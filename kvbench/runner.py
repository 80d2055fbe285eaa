"""Plans and executes a suite run: resolve workload, model, device and engines; validate
everything before any work starts; run each engine through the harness; write records."""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.clocks import Clock, VirtualClock, WallClock
from kvbench.devices import DeviceSpec, kv_budget_bytes, parse_device
from kvbench.engines.costmodel import CostModel
from kvbench.engines.factory import EngineOptions, build_engine, build_kv_manager
from kvbench.engines.presets import ModelPreset, get_preset
from kvbench.engines.scheduler import Scheduler, SchedulerConfig
from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.harness import EngineRun, RequestTiming, StepLog, run_engine
from kvbench.machine import machine_info
from kvbench.plots import write_plots
from kvbench.records import RunRecord, build_record
from kvbench.repeats import fold_repeats
from kvbench.report import summary_markdown
from kvbench.sharding import Shard
from kvbench.suite import EngineSection, Suite
from kvbench.telemetry import Telemetry
from kvbench.units import parse_bytes
from kvbench.workloads.model import Workload


@dataclass(slots=True)
class RunPlan:
    suite: Suite
    workload: Workload
    preset: ModelPreset
    device: DeviceSpec
    clock: str
    opts: EngineOptions
    engines: list[tuple[str, EngineSection]]
    out_dir: Path
    command: str
    warnings: list[str] = field(default_factory=list)
    repeats: int = 1


def load_workload(suite: Suite, base: Path | None) -> Workload:
    from kvbench.workloads.io import load_workload as load_jsonl
    from kvbench.workloads.presets import generate_preset
    from kvbench.workloads.traces import import_trace

    w = suite.workload
    resolve = (lambda p: Path(p)) if base is None else (lambda p: (base / p))
    if w.file is not None:
        wl = load_jsonl(resolve(w.file))
        if w.num_requests is not None:
            wl.requests = wl.requests[: w.num_requests]
        return wl
    if w.trace is not None:
        assert w.path is not None
        return import_trace(w.trace, resolve(w.path), limit=w.num_requests, seed=w.seed)
    return generate_preset(w.preset or "mixed-text", num_requests=w.num_requests, seed=w.seed)


def plan_run(
    suite: Suite, base: Path | None, out_dir: Path | None, command: str,
    *, repeats: int = 1, shard: Shard | None = None,
) -> RunPlan:
    """``shard`` keeps its share of the suite's engines (possibly none)."""
    if repeats < 1:
        raise KvbenchError(f"--repeat must be at least 1, not {repeats}")
    run = suite.run
    preset = get_preset(suite.model.preset)
    if suite.model.dtype:
        preset = preset.with_dtype(suite.model.dtype)
    device = parse_device(run.device)
    clock = run.clock
    if clock == "auto":
        clock = "virtual" if device.kind == "sim" else "wall"
    if device.kind == "sim" and clock == "wall":
        raise KvbenchError(
            "a simulated device has no real time: use --clock virtual with --device sim:..."
        )
    max_len = run.max_model_len or preset.max_position
    if max_len > preset.max_position:
        raise KvbenchError(
            f"max_model_len {max_len} exceeds {preset.name}'s context of {preset.max_position}"
        )
    sched = SchedulerConfig(
        max_model_len=max_len,
        max_num_seqs=run.max_num_seqs,
        max_num_batched_tokens=run.max_num_batched_tokens,
        chunked_prefill=run.chunked_prefill,
    )
    sched.validate()
    kv_memory = parse_bytes(run.kv_memory) if run.kv_memory else None
    opts = EngineOptions(
        preset=preset,
        device=device,
        kv_bytes=kv_budget_bytes(
            device, preset, kv_memory=kv_memory,
            gpu_memory_utilization=run.gpu_memory_utilization,
            max_num_batched_tokens=run.max_num_batched_tokens, max_num_seqs=run.max_num_seqs,
        ),
        block_size=run.block_size,
        prefix_caching=run.prefix_caching,
        scheduler=sched,
        weights=suite.model.weights,
        seed=suite.workload.seed,
        attention=run.attention,
    )
    if not run.engines:
        raise KvbenchError("no engines selected: pass --engines, e.g. --engines paged,contiguous")
    engines = [(name, suite.engine(name)) for name in run.engines]
    if shard is not None:
        engines = shard.select(engines)
    workload = load_workload(suite, base)
    if not workload.requests:
        raise KvbenchError("the workload has no requests")
    if out_dir is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir = Path("runs") / f"{suite.name}-{stamp}"
    plan = RunPlan(
        suite, workload, preset, device, clock, opts, engines, out_dir, command, repeats=repeats
    )
    if device.profile is not None:
        from kvbench.calibrate import load_profile

        fitted = load_profile(device.profile).model
        if fitted != preset.name:
            plan.warnings.append(
                f"profile {device.profile} was fitted for {fitted}, not {preset.name}: its "
                f"coefficients may not transfer; calibrate with --model {preset.name}"
            )
    for name, section in engines:
        _precheck(plan, name, section)
    return plan


def _precheck(plan: RunPlan, name: str, section: EngineSection) -> None:
    """Fail before any work when an engine can run nothing; warn about requests it rejects."""
    if section.kind == "vllm":
        from kvbench.engines.vllm import check_vllm

        check_vllm(section, plan.opts)
        kv_check = None
    else:
        kv_check = Scheduler(plan.opts.scheduler, build_kv_manager(section, plan.opts))
    if kv_check is None:
        return
    reasons = [r for r in map(kv_check.rejection, plan.workload.requests) if r is not None]
    if len(reasons) == len(plan.workload.requests):
        raise KvbenchError(f"engine {name!r} can run none of the requests: {reasons[0]}")
    if reasons:
        plan.warnings.append(
            f"engine {name!r} will reject {len(reasons)} of {len(plan.workload.requests)} "
            f"requests that can never fit (listed as rejected in its record); first: {reasons[0]}"
        )


def make_telemetry(plan: RunPlan) -> Telemetry:
    # The record's machine identity imports torch; do it before the first engine runs, so
    # that every engine's RSS includes the same libraries.
    machine_info()
    return Telemetry.for_device(plan.device.kind, plan.device.torch_device)


def make_clock(plan: RunPlan) -> Clock:
    if plan.clock == "wall":
        return WallClock()
    return VirtualClock(CostModel(plan.preset, plan.device.hardware, plan.device.tp))


def start_and_run(
    plan: RunPlan,
    name: str,
    section: EngineSection,
    progress: Callable[[int], None] | None,
    waves: int = 1,
) -> tuple[EngineRun, dict]:
    """Build one engine and drive it through the workload. An engine that fails to start
    yields a failed run (its record is still written); a configuration error propagates."""
    try:
        engine = build_engine(name, section, plan.opts)
    except KvbenchError:
        raise
    except Exception as exc:
        timings = {r.id: RequestTiming(r) for r in plan.workload.requests}
        run = EngineRun(name, plan.workload, plan.clock, timings, StepLog(), waves=waves)
        run.status, run.error = "failed", f"engine failed to start: {type(exc).__name__}: {exc}"
        return run, {"kind": section.kind, **section.model_dump()}
    config = {"kind": section.kind, **section.model_dump(), **engine.describe()}
    run = run_engine(
        engine, plan.workload, make_clock(plan), progress,
        telemetry=make_telemetry(plan), waves=waves,
    )
    # Facts learned while running (vLLM's kv-equivalent multimodal inputs) complete it.
    config.update((k, v) for k, v in engine.describe().items() if k not in config)
    return run, config


def execute_plan(
    plan: RunPlan,
    on_engine: Callable[[str], Callable[[int], None] | None] | None = None,
) -> list[RunRecord]:
    """Run every engine in turn, ``plan.repeats`` rounds of all engines (so that slow drift
    hits every engine alike); each record is written as soon as its engine ends, folded over
    its repeats so far. A failed engine does not stop the others and is not repeated; Ctrl-C
    writes the current engine's record and stops."""
    if plan.suite.run.cpu_threads is not None and plan.device.kind == "cpu":
        import torch

        torch.set_num_threads(plan.suite.run.cpu_threads)
    runs: dict[str, list[RunRecord]] = {}
    for repeat, (name, section) in itertools.product(range(plan.repeats), plan.engines):
        if any(r.status != "ok" for r in runs.get(name, [])):
            continue
        label = name if plan.repeats == 1 else f"{name} ({repeat + 1}/{plan.repeats})"
        progress = on_engine(label) if on_engine else None
        run, config = start_and_run(plan, name, section, progress)
        record = build_record(
            run, command=plan.command, suite=plan.suite.name, engine_config=config,
            model=plan.preset.to_json(), device=plan.device.label, slo=plan.suite.run.slo,
        )
        runs.setdefault(name, []).append(record)
        fold_repeats(runs[name]).write(plan.out_dir / f"{name}.json")
        if run.status == "interrupted":
            break
    records = [fold_repeats(rs) for rs in runs.values()]
    write_text_atomic(plan.out_dir / "summary.md", summary_markdown(records))
    # After the records: a figure that fails to draw costs only itself.
    plan.warnings += write_plots(records, plan.out_dir)[1]
    return records

