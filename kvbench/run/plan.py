"""Plans a suite run: resolve workload, model, device and engines, and validate everything
before any work starts."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.engines.config import EngineConfig, EngineSettings, engine_config
from kvbench.engines.hardware import DeviceSpec
from kvbench.engines.presets import ModelPreset, get_preset
from kvbench.engines.scheduler import SchedulerConfig
from kvbench.errors import KvbenchError
from kvbench.run.devices import kv_budget_bytes, parse_device
from kvbench.run.sharding import Shard
from kvbench.run.suite import Suite
from kvbench.units import parse_bytes
from kvbench.workloads.model import Workload


@dataclass(slots=True)
class RunPlan:
    suite: Suite
    workload: Workload
    preset: ModelPreset
    device: DeviceSpec
    clock: str
    settings: EngineSettings
    engines: list[tuple[str, EngineConfig]]
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
    settings = EngineSettings(
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
    engines = [(name, engine_config(name, suite.engine(name), settings)) for name in run.engines]
    if shard is not None:
        engines = shard.select(engines)
    workload = load_workload(suite, base)
    if not workload.requests:
        raise KvbenchError("the workload has no requests")
    if out_dir is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir = Path("runs") / f"{suite.name}-{stamp}"
    plan = RunPlan(
        suite, workload, preset, device, clock, settings, engines, out_dir, command,
        repeats=repeats,
    )
    if device.profile is not None:
        from kvbench.tools.calibrate.profile import load_profile

        fitted = load_profile(device.profile).model
        if fitted != preset.name:
            plan.warnings.append(
                f"profile {device.profile} was fitted for {fitted}, not {preset.name}: its "
                f"coefficients may not transfer; calibrate with --model {preset.name}"
            )
    for name, config in engines:
        _precheck(plan, name, config)
    return plan


def _precheck(plan: RunPlan, name: str, config: EngineConfig) -> None:
    """Fail before any work when an engine cannot run, or can run none of the requests; warn
    about requests it rejects."""
    config.section.check(config)
    rejection = config.section.admission(config)
    reasons = [r for r in map(rejection, plan.workload.requests) if r is not None]
    if len(reasons) == len(plan.workload.requests):
        raise KvbenchError(f"engine {name!r} can run none of the requests: {reasons[0]}")
    if reasons:
        plan.warnings.append(
            f"engine {name!r} will reject {len(reasons)} of {len(plan.workload.requests)} "
            f"requests that can never fit (listed as rejected in its record); first: {reasons[0]}"
        )
