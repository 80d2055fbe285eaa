"""Plans a suite run: resolve workload, model, device and engines, and validate everything
before any work starts."""

from __future__ import annotations

import datetime as dt
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import (
    EngineConfig,
    EngineSection,
    EngineSettings,
    KVPolicy,
    engine_config,
)
from kvbench.engines.kv.offload import OffloadSpec
from kvbench.engines.model.presets import ModelPreset, get_preset
from kvbench.engines.sim.device_memory import MemoryOptions
from kvbench.engines.sim.hardware import DeviceSpec
from kvbench.errors import KvbenchError
from kvbench.results.paths import check_path_component
from kvbench.run.cluster import check_cluster, check_replica_memory
from kvbench.run.devices import kv_budget_bytes, on_demand_kv_bytes, parse_device
from kvbench.run.outdir import OutDirLock, prepare_out_dir
from kvbench.run.overrides import TIMED_TRACE_KINDS
from kvbench.run.sharding import Shard
from kvbench.run.suite import RunSection, Suite
from kvbench.units import format_bytes, parse_bytes
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
    # Choices made for the user, each worth one line of output.
    notes: list[str] = field(default_factory=list)
    # The arrival process the engines see, in words ("trace timestamps (...)", "Poisson at
    # 4 req/s", "all at 0 s"): printed with the run's header.
    arrivals: str = ""
    repeats: int = 1
    max_concurrency: int | None = None
    # On a CPU: torch's CPU threads every engine computes at (the suite's cpu_threads, else
    # torch's default when the run is planned); None elsewhere.
    cpu_threads: int | None = None
    # Each engine run in a fresh process (wall-clock runs unless run.in_process).
    isolated: bool = False
    # Names this run in its records and its folder's manifest; the folder's lock.
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lock: OutDirLock | None = None


def load_workload(suite: Suite, base: Path | None) -> Workload:
    from kvbench.workloads.generator import generate
    from kvbench.workloads.io import load_workload as load_jsonl
    from kvbench.workloads.presets import generate_preset
    from kvbench.workloads.spec import parse_spec
    from kvbench.workloads.traces import import_trace

    w = suite.workload
    if w.spec is not None:
        spec = parse_spec(w.spec, f"suite {suite.name}: [workload.spec]")
        return generate(spec, num_requests=w.num_requests, seed=w.seed, name=f"{suite.name}-spec",
                        source=f"suite {suite.name}")
    resolve = (lambda p: Path(p)) if base is None else (lambda p: (base / p))
    if w.file is not None:
        return load_jsonl(resolve(w.file), limit=w.num_requests)
    if w.trace is not None:
        assert w.path is not None
        return import_trace(w.trace, resolve(w.path), limit=w.num_requests, seed=w.seed,
                            image_rule=w.image_rule)
    return generate_preset(w.preset or "mixed-text", num_requests=w.num_requests, seed=w.seed)


def plan_run(
    suite: Suite, base: Path | None, out_dir: Path | None, command: str,
    *, repeats: int | None = None, shard: Shard | None = None, force: bool = False,
) -> RunPlan:
    """``shard`` keeps its share of the suite's engines (possibly none); ``force`` lets the
    run replace the records an existing ``out_dir`` holds; ``repeats`` (--repeat) overrides
    the suite's ``run.repeat``."""
    run = suite.run
    repeats = run.repeat if repeats is None else repeats
    if repeats < 1:
        raise KvbenchError(f"--repeat must be at least 1, not {repeats}")
    preset = get_preset(suite.model.preset)
    if suite.model.dtype:
        preset = preset.with_dtype(suite.model.dtype)
    device = parse_device(run.device)
    preset.check_tensor_parallel(device.tp)
    clock = _clock(run.clock, device)
    notes: list[str] = []
    settings, sections, warnings = _engine_settings(suite, preset, device, notes)
    engines = [(name, engine_config(name, section, settings)) for name, section in sections]
    if shard is not None:
        engines = shard.select(engines)
    workload, recorded = _workload(suite, base)
    warnings += workload.warnings
    for name, _ in engines:  # each names its record file
        check_path_component(name, "engine")
    if out_dir is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out_dir = Path("runs") / f"{check_path_component(suite.name, 'suite')}-{stamp}"
    plan = RunPlan(
        suite, workload, preset, device, clock, settings, engines, out_dir, command,
        warnings=warnings, notes=notes, repeats=repeats, max_concurrency=run.max_concurrency,
        arrivals=describe_arrivals(workload, run, recorded),
    )
    _settle(plan)
    plan.isolated = clock == "wall" and not run.in_process
    plan.lock = prepare_out_dir(out_dir, force)
    return plan


def _clock(clock: str, device: DeviceSpec) -> str:
    """The run's clock: ``auto`` is the virtual one on a simulated device, else the wall."""
    if clock == "auto":
        clock = "virtual" if device.kind == "sim" else "wall"
    if device.kind == "sim" and clock == "wall":
        raise KvbenchError(
            "a simulated device has no real time: use --clock virtual with --device sim:..."
        )
    return clock


def _scheduler(run: RunSection, preset: ModelPreset) -> SchedulerConfig:
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
    return sched


def _engine_settings(
    suite: Suite, preset: ModelPreset, device: DeviceSpec, notes: list[str]
) -> tuple[EngineSettings, list[tuple[str, EngineSection]], list[str]]:
    """What every engine of the run shares, the suite's sections of the engines selected,
    and warnings about the KV budget."""
    run = suite.run
    sched = _scheduler(run, preset)
    kv_memory = parse_bytes(run.kv_memory, "--kv-memory") if run.kv_memory else None
    warnings = _check_kv_memory(kv_memory, device)
    if not run.engines:
        raise KvbenchError("no engines selected: pass --engines, e.g. --engines paged,contiguous")
    sections = [(name, suite.engine(name)) for name in run.engines]
    block_size = _block_size(run.block_size, "block_size" in run.model_fields_set,
                             [s for _, s in sections], device, notes)
    memory = _memory_options(run, device)
    if memory.kv_allocation == "on-demand" and kv_memory is None:
        kv_bytes = on_demand_kv_bytes(device, preset)
    else:
        kv_bytes = kv_budget_bytes(
            device, preset, kv_memory=kv_memory,
            gpu_memory_utilization=run.gpu_memory_utilization,
            max_num_batched_tokens=run.max_num_batched_tokens, max_num_seqs=run.max_num_seqs,
            attention=memory.attention_impl, page_tokens=block_size,
        )
    settings = EngineSettings(
        preset=preset,
        device=device,
        kv_bytes=kv_bytes,
        block_size=block_size,
        prefix_caching=run.prefix_caching,
        scheduler=sched,
        weights=suite.model.weights,
        seed=suite.workload.seed,
        attention=run.attention,
        memory=memory,
        offload=_offload(run.kv_offload, sections, warnings),
        preemption=run.kv_preemption,
    )
    if run.kv_preemption == "swap":
        _paged_only("--kv-preemption swap", "swaps no KV; it recomputes", sections, warnings)
    return settings, sections, warnings


def _offload(text: str | None, sections: list[tuple[str, EngineSection]],
             warnings: list[str]) -> OffloadSpec | None:
    """The run's offload tiers (``--kv-offload``), with a warning for each engine they
    leave out: only the paged policy keeps blocks below device memory."""
    if text is None:
        return None
    spec = OffloadSpec.model_validate(text)
    _paged_only("--kv-offload", "has no offload tiers; it runs without them", sections,
                warnings)
    return spec


def _paged_only(flag: str, instead: str, sections: list[tuple[str, EngineSection]],
                warnings: list[str]) -> None:
    """A warning for each engine a paged-only run flag leaves out."""
    from kvbench.engines.kv.paged import PagedPolicy

    for name, section in sections:
        if not isinstance(section, PagedPolicy):
            warnings.append(f"{flag}: engine {name} ({section.kind}) {instead}")


def _workload(suite: Suite, base: Path | None) -> tuple[Workload, bool]:
    """The suite's workload, re-timed to ``run.request_rate`` if given; and whether its
    arrivals came from a trace's timestamps."""
    workload = load_workload(suite, base)
    if not workload.requests:
        raise KvbenchError("the workload has no requests")
    recorded = workload.spec.get("trace") in TIMED_TRACE_KINDS
    run = suite.run
    if run.request_rate is not None:
        from kvbench.workloads.retime import retime

        workload = retime(workload, run.request_rate, run.burstiness, seed=suite.workload.seed)
    return workload, recorded


def _settle(plan: RunPlan) -> None:
    """What the plan settles once its parts are known: a CPU run's threads, a calibration
    profile fitted for another model (a warning), the cluster, and each engine."""
    run, preset, device = plan.suite.run, plan.preset, plan.device
    if device.kind == "cpu":
        from kvbench.run.threads import torch_threads

        plan.cpu_threads = run.cpu_threads if run.cpu_threads is not None else torch_threads()
    if device.profile is not None:
        from kvbench.tools.calibrate.profile import load_profile

        fitted = load_profile(device.profile).model
        if fitted != preset.name:
            plan.warnings.append(
                f"profile {device.profile} was fitted for {fitted}, not {preset.name}: its "
                f"coefficients may not transfer; calibrate with --model {preset.name}"
            )
    requests = plan.workload.requests
    check_cluster(plan.suite.cluster, device, plan.clock, plan.engines, requests)
    check_replica_memory(plan.suite.cluster, plan.engines, len(requests))
    for name, config in plan.engines:
        _precheck(plan, name, config)


def describe_arrivals(workload: Workload, run: RunSection, recorded: bool) -> str:
    """The arrival process of ``workload`` in words; ``recorded``: its arrivals came from a
    trace's timestamps (before any re-timing by ``run.request_rate``)."""
    times = [r.arrival_s for r in workload.requests]
    n, span_s = len(times), max(times) - min(times)
    rate, burstiness = run.request_rate, run.burstiness
    if rate is not None:
        replaced = (" (re-timing a trace: without a request rate its timestamps are "
                    "replayed)") if recorded else ""
        if rate == math.inf:
            return f"all at 0 s (request rate inf){replaced}"
        shape = "Poisson" if burstiness == 1 else f"gamma, burstiness {burstiness:g},"
        return f"{shape} at {rate:g} req/s{replaced}"
    if span_s == 0:
        return f"all at {times[0]:g} s"
    spread = f"{n:,} requests over {span_s:,.1f} s, {(n - 1) / span_s:.3g} req/s on average"
    if recorded:
        return f"trace timestamps ({spread})"
    arrival = workload.spec.get("arrival") or {}
    if arrival.get("kind") == "poisson":
        return f"Poisson at {arrival['rate']:g} req/s (the workload's own; {spread})"
    if arrival.get("kind") == "gamma":
        return (f"gamma, burstiness {arrival.get('burstiness', 1):g}, at {arrival['rate']:g} req/s "
                f"(the workload's own; {spread})")
    return f"the workload's own arrival times ({spread})"


def _memory_options(run: RunSection, device: DeviceSpec) -> MemoryOptions:
    """The simulated device's memory model; a real device's memory is measured, so asking
    to model it there is a mistake."""
    options = MemoryOptions(run.attention_impl, run.kv_allocation, run.extra_kv_window_tokens)
    if device.kind != "sim" and options != MemoryOptions():
        raise KvbenchError(
            "attention_impl, kv_allocation and extra_kv_window_tokens model a simulated "
            f"device's memory; {device.label} is measured (choose its kernels with --attention)"
        )
    return options


def _check_kv_memory(kv_memory: int | None, device: DeviceSpec) -> list[str]:
    """A KV budget larger than the device cannot exist: an error on a simulated device, a
    warning on a real one (whose allocation will then fail or swap)."""
    if kv_memory is None:
        return []
    memory = device.hardware.memory_bytes * device.tp
    if kv_memory <= memory:
        return []
    msg = (
        f"--kv-memory {format_bytes(kv_memory)} exceeds {device.label}'s memory of "
        f"{format_bytes(memory)}"
    )
    if device.kind == "sim":
        raise KvbenchError(f"{msg}: give a smaller budget, or more GPUs (sim:GPUxTP)")
    return [f"{msg}: the KV pool will not fit; give a smaller --kv-memory"]


def _block_size(
    block_size: int, explicit: bool, sections: list[EngineSection], device: DeviceSpec,
    notes: list[str],
) -> int:
    """The run's block size, raised to the multiple an engine needs on ``device`` when the
    user did not choose it (every paged engine shares it, so their layouts compare)."""
    multiple = math.lcm(*(s.block_multiple(device) for s in sections))
    if block_size % multiple == 0 or explicit:
        return block_size
    chosen = -(-block_size // multiple) * multiple
    needs = ", ".join(sorted({s.kind for s in sections if s.block_multiple(device) > 1}))
    notes.append(
        f"block size {chosen} for every paged engine: {needs} on {device.label} needs a "
        f"multiple of {multiple} (give --block-size to choose another)"
    )
    return chosen


def _precheck(plan: RunPlan, name: str, config: EngineConfig) -> None:
    """Fail before any work when an engine cannot run, or can run none of the requests; warn
    about requests it rejects."""
    section = config.section
    if section.realtime and plan.clock != "wall":
        raise KvbenchError(
            f"engine {name!r} ({section.kind}) drives a live server in real time: use "
            "--clock wall (and a real --device, not sim:...)"
        )
    plan.warnings += [f"engine {name!r}: {w}" for w in section.check(config)]
    if isinstance(section, KVPolicy) and config.device.kind != "sim":
        # The kernels of real compute, built or imported now (a missing compiler or triton
        # says so before any engine runs).
        from kvbench.kernels.backend import collected_warnings, get_backend

        with collected_warnings() as said:  # auto's fallback, an unusable build cache
            get_backend(config.attention, config.device.torch_device)
        plan.warnings += said
    rejection = section.admission(config)
    reasons = [r for r in map(rejection, plan.workload.requests) if r is not None]
    if len(reasons) == len(plan.workload.requests):
        raise KvbenchError(f"engine {name!r} can run none of the requests: {reasons[0]}")
    if reasons:
        plan.warnings.append(
            f"engine {name!r} will reject {len(reasons)} of {len(plan.workload.requests)} "
            f"requests that can never fit (listed as rejected in its record); first: {reasons[0]}"
        )
