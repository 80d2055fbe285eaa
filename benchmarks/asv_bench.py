"""asv benchmarks (``nox -s asv``; history dashboard with ``asv publish``).

- ``KVMetrics.track_*``: the deterministic KV and concurrency numbers of the ``quick-sim``
  suite (simulated A100, virtual clock: identical on every machine, so a step in the graph
  is a code change, never noise), per engine and paged block size.
- ``EngineStep.time_*``: one engine step on a steady batch: the simulated engine (scheduler,
  KV manager and cost model: the host-side overhead) and real compute with the tiny model on
  the CPU.
- ``SimSpeed.track_*``: the simulator's own speed replaying the ``quick-sim`` suite, with
  decode fast-forward and step by step: simulated steps per wall second and simulated
  seconds per wall second, each the median of three replays (higher is better: their units
  say so).
- ``SimTraces.track_realtime_factor``: the same, replaying the whole Azure conversation and
  Mooncake traces (from ``../shared/traces``; skipped where they are not there).
- ``SimMemory.track_*``: what a long simulated replay keeps for its record (step log and
  request timings), in bytes per simulated step and per request, counted by tracemalloc:
  deterministic for a given Python and numpy, so a step in the graph is a code change.
- ``Attention.time_*``, ``NativeAttention.time_*``: decodes on small shapes through the torch
  reference attention kernels and the native C decode kernel (skipped without a C compiler).
- ``peakmem_*``: peak process memory of a short real-compute run.
- ``TraceImport.time_import``: importing the full public traces.
- ``EngineBound.track_output_throughput``, ``EngineBoundVsVLLM.track_*``: output tokens/s on
  the engine-bound suite (every request queued at once, real compute on the CPU) and the
  paged / vLLM ratio (skipped, saying why, where vLLM is not installed).
- ``Fidelity.track_median_error_pct``: the simulator's median per-request TTFT and TPOT
  error against the stored real runs of ``results/fidelity/paged-cpu`` (the built-in engine
  on a CPU), simulated again with this checkout's cost model and fit: deterministic, so a
  step in the graph is a change to the model, never noise.
- ``KVBookkeeping.time_churn``: one KV manager's allocate, grow and free of every policy
  (``benchmarks/kv_bookkeeping.py``, which also prints the per-page table).

asv treats smaller as better. Every metric here is lower-is-better except
``track_max_concurrent_requests`` and the engine-bound throughputs and ratio (their units say
so): a drop in those graphs is the regression.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

from kvbench.engines.registry import build_engine
from kvbench.engines.sim.costmodel import CostModel
from kvbench.results.metrics import summarize
from kvbench.run.clocks import VirtualClock
from kvbench.run.harness import run_engine
from kvbench.run.plan import RunPlan, plan_run
from kvbench.run.suite import load_suite
from kvbench.workloads.model import Request, Segment

ENGINES = ["paged", "contiguous"]
BLOCK_SIZES = [16, 32]
GIB, MIB = float(1 << 30), float(1 << 20)


def _plan(suite_name: str, block_size: int, **run: Any) -> RunPlan:
    suite, base = load_suite(suite_name)
    suite.run.block_size = block_size
    for key, value in run.items():
        setattr(suite.run, key, value)
    return plan_run(suite, base, None, f"asv {suite_name}")


def _engine(plan: RunPlan, name: str):
    return build_engine(dict(plan.engines)[name])


def _skip_unused_block_size(engine: str, block_size: int) -> None:
    # A contiguous arena has no blocks: one block size stands for all.
    if engine == "contiguous" and block_size != BLOCK_SIZES[0]:
        raise NotImplementedError("contiguous KV has no block size")


class KVMetrics:
    params = (ENGINES, BLOCK_SIZES)
    param_names = ("engine", "block_size")
    timeout = 600

    def setup_cache(self) -> dict[str, dict[str, Any]]:
        out = {}
        for block_size in BLOCK_SIZES:
            plan = _plan("quick-sim", block_size)
            clock = VirtualClock(CostModel(plan.preset, plan.device.hardware, plan.device.tp))
            for engine in ENGINES:
                run = run_engine(_engine(plan, engine), plan.workload, clock)
                out[f"{engine}/{block_size}"] = summarize(run)
                clock = VirtualClock(CostModel(plan.preset, plan.device.hardware, plan.device.tp))
        return out

    def setup(self, cache, engine: str, block_size: int) -> None:
        _skip_unused_block_size(engine, block_size)

    @staticmethod
    def _get(cache, engine: str, block_size: int, key: str) -> float:
        return float(cache[f"{engine}/{block_size}"][key] or 0.0)

    def track_kv_waste_pct(self, cache, engine, block_size):
        return self._get(cache, engine, block_size, "kv_waste_pct")

    track_kv_waste_pct.unit = "%"  # type: ignore[attr-defined]

    def track_peak_kv_reserved(self, cache, engine, block_size):
        return self._get(cache, engine, block_size, "peak_kv_reserved_bytes") / GIB

    track_peak_kv_reserved.unit = "GiB"  # type: ignore[attr-defined]

    def track_kv_reserved_per_request(self, cache, engine, block_size):
        peak = self._get(cache, engine, block_size, "peak_kv_reserved_bytes")
        return peak / max(self._get(cache, engine, block_size, "max_concurrent_requests"), 1) / MIB

    track_kv_reserved_per_request.unit = "MiB per concurrent request"  # type: ignore[attr-defined]

    def track_max_concurrent_requests(self, cache, engine, block_size):
        return self._get(cache, engine, block_size, "max_concurrent_requests")

    track_max_concurrent_requests.unit = "requests (higher is better)"  # type: ignore[attr-defined]

    def track_p99_ttft_ms(self, cache, engine, block_size):
        return self._get(cache, engine, block_size, "p99_ttft_ms")

    track_p99_ttft_ms.unit = "ms (simulated)"  # type: ignore[attr-defined]

    def track_preemptions(self, cache, engine, block_size):
        return self._get(cache, engine, block_size, "preemptions")

    track_preemptions.unit = "preemptions"  # type: ignore[attr-defined]


class EngineStep:
    params = (ENGINES, BLOCK_SIZES)
    param_names = ("engine", "block_size")
    timeout = 300
    # Building a real-compute engine dominates; one process per case and a few samples
    # keep the suite to minutes on a small CPU.
    rounds = 1
    repeat = (2, 5, 5.0)

    def setup(self, engine: str, block_size: int) -> None:
        _skip_unused_block_size(engine, block_size)
        sim = _plan("quick-sim", block_size, kv_memory=None)
        self.sim = _engine(sim, engine)
        cpu = _plan("quick-cpu", block_size, kv_memory="16MiB")
        self.cpu = _engine(cpu, engine)
        for eng, seqs, prompt, output in ((self.sim, 16, 512, 3000), (self.cpu, 2, 64, 1800)):
            for i in range(seqs):
                eng.add(Request(f"asv-{i}", 0.0, (Segment("text", prompt, f"asv/{i}"),), output))
            # Prefill (chunked or not) ends within a few steps; after it every step decodes
            # the same batch.
            for _ in range(8):
                eng.step()

    def teardown(self, engine: str, block_size: int) -> None:
        self.sim.close()
        self.cpu.close()

    def time_sim_step(self, engine, block_size):
        self.sim.step()

    def time_cpu_decode_step(self, engine, block_size):
        self.cpu.step()


class SimSpeed:
    params = (ENGINES, [True, False])
    param_names = ("engine", "fast_forward")
    timeout = 600
    REPEATS = 3

    def setup_cache(self) -> dict[str, tuple[float, float]]:
        """(steps/s, simulated s per wall s), medians of ``REPEATS`` replays, per case."""
        plan = _plan("quick-sim", BLOCK_SIZES[0])
        out = {}
        for engine in ENGINES:
            for fast_forward in (True, False):
                steps, speed = [], []
                for _ in range(self.REPEATS):
                    clock = VirtualClock(CostModel(plan.preset, plan.device.hardware,
                                                   plan.device.tp))
                    eng = _engine(plan, engine)
                    t0 = time.perf_counter()
                    run = run_engine(eng, plan.workload, clock, fast_forward=fast_forward)
                    wall = time.perf_counter() - t0
                    steps.append(len(run.steps) / wall)
                    speed.append(run.duration_s / wall)
                out[f"{engine}/{fast_forward}"] = (statistics.median(steps),
                                                   statistics.median(speed))
        return out

    def track_steps_per_s(self, cache, engine, fast_forward):
        return cache[f"{engine}/{fast_forward}"][0]

    track_steps_per_s.unit = "simulated steps/s (higher is better)"  # type: ignore[attr-defined]

    def track_realtime_factor(self, cache, engine, fast_forward):
        return cache[f"{engine}/{fast_forward}"][1]

    track_realtime_factor.unit = "x real time (higher is better)"  # type: ignore[attr-defined]


TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
# Public traces replayed as the speed goals name them: (importer, file, simulated device).
# The policies the event replay takes (paged-lfu: the C pool's LFU heap).
TRACE_ENGINES = ["paged", "paged-lfu", "contiguous"]
TRACE_CASES = {
    "azure-conv": ("azure", "azure_llm_2023_conv.csv", "sim:a100-80gb"),
    "mooncake": ("mooncake", "mooncake_synthetic_trace.jsonl", "sim:h200"),
}


class SimTraces:
    """The simulator's real-time factor replaying whole public traces (the ``mooncake-sim``
    suite's model and limits), with decode fast-forward: simulated seconds per wall second of
    the replay, median of three."""

    params = (list(TRACE_CASES), TRACE_ENGINES)
    param_names = ("trace", "engine")
    timeout = 900
    REPEATS = 3

    def setup_cache(self) -> dict[str, float]:
        out = {}
        for name, (kind, file, device) in TRACE_CASES.items():
            if not (TRACES / file).is_file():
                continue
            suite, base = load_suite("mooncake-sim")
            suite.workload.trace, suite.workload.path = kind, str(TRACES / file)  # type: ignore[assignment]
            suite.run.device, suite.run.engines = device, TRACE_ENGINES
            plan = plan_run(suite, base, None, f"asv {name} on {device}")
            for engine in TRACE_ENGINES:
                speed = []
                for _ in range(self.REPEATS):
                    clock = VirtualClock(CostModel(plan.preset, plan.device.hardware,
                                                   plan.device.tp))
                    eng = _engine(plan, engine)
                    t0 = time.perf_counter()
                    run = run_engine(eng, plan.workload, clock)
                    speed.append(run.duration_s / (time.perf_counter() - t0))
                out[f"{name}/{engine}"] = statistics.median(speed)
        return out

    def setup(self, cache, trace: str, engine: str) -> None:
        if f"{trace}/{engine}" not in cache:
            raise NotImplementedError(f"{TRACES / TRACE_CASES[trace][1]} is not there")

    def track_realtime_factor(self, cache, trace, engine):
        return cache[f"{trace}/{engine}"]

    track_realtime_factor.unit = "x real time (higher is better)"  # type: ignore[attr-defined]


class OffloadReplay:
    """The Mooncake trace replayed with offload tiers below HBM (the ``offload`` suite:
    Qwen2.5-7B on a simulated H200; paged alone, a 64 GiB cpu tier, and 256 GiB cpu + 2 TiB
    disk): simulated seconds per wall second of the replay, median of three rounds, the
    engines in turn within each. The goal is at least 500x real time."""

    params = (["paged", "cpu64-pcie5", "cpu256-disk2t"],)
    param_names = ("engine",)
    timeout = 900
    REPEATS = 3

    def setup_cache(self) -> dict[str, float] | None:
        if not (TRACES / TRACE_CASES["mooncake"][1]).is_file():
            return None
        suite, base = load_suite("offload")
        plan = plan_run(suite, base, None, "asv offload replay")
        speed: dict[str, list[float]] = {e: [] for e in self.params[0]}
        for _ in range(self.REPEATS):
            for engine in speed:
                eng = _engine(plan, engine)
                t0 = time.perf_counter()
                run = run_engine(eng, plan.workload, VirtualClock(
                    CostModel(plan.preset, plan.device.hardware, plan.device.tp)))
                speed[engine].append(run.duration_s / (time.perf_counter() - t0))
        return {e: statistics.median(v) for e, v in speed.items()}

    def setup(self, cache, engine: str) -> None:
        if cache is None:
            raise NotImplementedError(f"{TRACES / TRACE_CASES['mooncake'][1]} is not there")

    def track_realtime_factor(self, cache, engine):
        return cache[engine]

    track_realtime_factor.unit = "x real time (higher is better)"  # type: ignore[attr-defined]


class PrefixOracleCost:
    """What the prefix-cache oracle (Belady's MIN over the run's block accesses) costs after a
    replay of the Mooncake trace with paged KV: its time as a share of the replay's wall
    time, median of three (the goal is at most 20%)."""

    timeout = 900
    REPEATS = 3

    def setup_cache(self) -> float | None:
        file = TRACES / TRACE_CASES["mooncake"][1]
        if not file.is_file():
            return None
        suite, base = load_suite("mooncake-sim")
        suite.workload.trace, suite.workload.path = "mooncake", str(file)  # type: ignore[assignment]
        plan = plan_run(suite, base, None, "asv prefix oracle")
        shares = []
        for _ in range(self.REPEATS):
            eng = _engine(plan, "paged")
            run = run_engine(eng, plan.workload, VirtualClock(
                CostModel(plan.preset, plan.device.hardware, plan.device.tp)))
            t0 = time.perf_counter()
            eng.prefix_oracle()
            shares.append(100 * (time.perf_counter() - t0) / run.wall_time_s)
        return statistics.median(shares)

    def setup(self, cache) -> None:
        if cache is None:
            raise NotImplementedError(f"{TRACES / TRACE_CASES['mooncake'][1]} is not there")

    def track_oracle_share_pct(self, cache):
        return cache

    track_oracle_share_pct.unit = "% of the replay's wall time (lower is better)"  # type: ignore[attr-defined]


class SimMemory:
    params = (ENGINES,)
    param_names = ("engine",)
    timeout = 600
    NUM_REQUESTS = 2000

    def setup_cache(self) -> dict[str, tuple[float, float]]:
        """Bytes the engine run holds when the replay ends (the engine itself released),
        per step and per request, of ``NUM_REQUESTS`` ``quick-sim`` requests on a
        simulated H200 (its default KV budget) with decode fast-forward."""
        suite, base = load_suite("quick-sim")
        suite.workload.num_requests = self.NUM_REQUESTS
        suite.run.device = "sim:h200"
        suite.run.kv_memory = None
        plan = plan_run(suite, base, None, "asv quick-sim on sim:h200")
        out = {}
        for engine in ENGINES:
            eng = _engine(plan, engine)
            clock = VirtualClock(CostModel(plan.preset, plan.device.hardware, plan.device.tp))
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                run = run_engine(eng, plan.workload, clock)
                del eng
                gc.collect()
                held = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            out[engine] = (held / len(run.steps), held / len(run.timings))
        return out

    def track_bytes_per_step(self, cache, engine):
        return cache[engine][0]

    track_bytes_per_step.unit = "bytes per simulated step"  # type: ignore[attr-defined]

    def track_bytes_per_request(self, cache, engine):
        return cache[engine][1]

    track_bytes_per_request.unit = "bytes per request"  # type: ignore[attr-defined]


class _Decodes:
    """Eight decodes of the tiny model at ``context`` keys, paged (scattered blocks) or
    contiguous, through ``kernels``' attention: ``self.fn(*self.args)``."""

    params = (["paged", "contiguous"], [256, 1024])
    param_names = ("layout", "context")

    def build(self, kernels, layout: str, context: int) -> None:
        import numpy as np
        import torch

        from kvbench.engines.model.presets import get_preset

        tiny, block, seqs = get_preset("tiny"), 16, 8
        gen = torch.Generator().manual_seed(0)
        blocks = -(-context // block)
        slots = seqs * blocks * block
        k = torch.randn(slots, tiny.num_kv_heads, tiny.head_dim, generator=gen)
        v = torch.randn(slots, tiny.num_kv_heads, tiny.head_dim, generator=gen)
        q = torch.randn(seqs, tiny.num_heads, tiny.head_dim, generator=gen)
        cu = torch.arange(0, seqs + 1, dtype=torch.int32)
        lens = torch.full((seqs,), context, dtype=torch.int32)
        scale = tiny.head_dim**-0.5
        if layout == "paged":
            order = np.random.default_rng(0).permutation(seqs * blocks)
            tables = torch.tensor(order.reshape(seqs, blocks), dtype=torch.int32)
            self.fn = kernels.paged_attention
            self.args = (q, k, v, tables, lens, cu, block, scale)
        else:
            starts = torch.arange(seqs, dtype=torch.int64) * blocks * block
            self.fn = kernels.contiguous_attention
            self.args = (q, k, v, starts, lens, cu, scale)


class Attention(_Decodes):
    def setup(self, layout: str, context: int) -> None:
        from kvbench.kernels import reference

        self.build(reference, layout, context)

    def time_reference_decode(self, layout, context):
        self.fn(*self.args)


class NativeAttention(_Decodes):
    def setup(self, layout: str, context: int) -> None:
        from kvbench.kernels import cpu_native

        if not cpu_native.available():
            raise NotImplementedError("the native kernel needs a C compiler")
        self.build(cpu_native, layout, context)

    def time_native_decode(self, layout, context):
        self.fn(*self.args)


def peakmem_cpu_run(engine: str) -> None:
    """Two short requests through the tiny model on the CPU: weights, KV tensors and
    activations of a real-compute engine."""
    eng = _engine(_plan("quick-cpu", BLOCK_SIZES[0]), engine)
    for i in range(2):
        eng.add(Request(f"asv-{i}", 0.0, (Segment("text", 128, f"asv/{i}"),), 8))
    while eng.has_unfinished():
        eng.step()
    eng.close()


peakmem_cpu_run.params = ENGINES  # type: ignore[attr-defined]
peakmem_cpu_run.param_names = ("engine",)  # type: ignore[attr-defined]
peakmem_cpu_run.timeout = 300  # type: ignore[attr-defined]


class TraceImport:
    """Importing the full public traces beside the repository (``../shared/traces``)."""

    params = (["azure:azure_llm_2023_conv.csv", "mooncake:mooncake_synthetic_trace.jsonl"],)
    param_names = ("trace",)
    timeout = 300

    def setup(self, trace: str) -> None:
        from pathlib import Path

        kind, name = trace.split(":")
        path = Path(__file__).resolve().parents[2] / "shared" / "traces" / name
        if not path.is_file():
            raise NotImplementedError(f"{path} is not here")
        self.kind, self.path = kind, path

    def time_import(self, trace: str) -> None:
        from kvbench.workloads.traces import import_trace

        import_trace(self.kind, self.path)


def _engine_bound(engines: list[str]) -> Any:
    """The engine-bound suite (every request queued at 0 s, the tiny model on the CPU at one
    thread) for ``engines``, 3 interleaved rounds, in a scratch folder: its records' ratio
    (:func:`kvbench.tools.engine_ratio.engine_ratio`)."""
    import tempfile
    from pathlib import Path

    from kvbench.run.execute import execute_plan
    from kvbench.tools.engine_ratio import engine_ratio

    suite, base = load_suite("engine-bound")
    suite.run.engines = engines
    with tempfile.TemporaryDirectory() as out:
        plan = plan_run(suite, base, Path(out), "asv engine-bound", repeats=3)
        execute_plan(plan)
        ratios = {e: engine_ratio(out, e, engines[-1]) for e in engines[:-1]}
    return ratios


def _vllm_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed in this environment: the engine-bound vLLM figures are "
                "not measured (run asv in the environment `nox -s vllm` builds)")
    return None


class EngineBound:
    """Output tokens/s of the built-in engine's paged and contiguous KV on the engine-bound
    suite (median of 3 rounds): real compute, so per machine. Higher is better (the unit
    says so)."""

    params = (["paged", "contiguous"],)
    param_names = ("engine",)
    timeout = 3600

    def setup_cache(self) -> dict[str, float]:
        import statistics

        (ratio,) = _engine_bound(["paged", "contiguous"]).values()
        return {e: statistics.median(v) for e, v in ratio.throughputs.items()}

    def track_output_throughput(self, cache, engine):
        return cache[engine]

    track_output_throughput.unit = "output tokens/s (higher is better)"  # type: ignore[attr-defined]


class EngineBoundVsVLLM:
    """The paged / vLLM output-throughput ratio on the engine-bound suite (median of the
    ratios of 3 interleaved rounds, equal CPU threads) and vLLM's own tokens/s. Skipped, with
    the reason, where vLLM is not installed. Higher is better (the units say so)."""

    timeout = 3600

    def setup_cache(self) -> dict[str, Any] | None:
        if _vllm_missing():
            return None
        (ratio,) = _engine_bound(["paged", "vllm"]).values()
        if ratio.median is None:
            raise RuntimeError(f"engine-bound paged/vLLM ratio not measured: {ratio.missing}")
        import statistics

        return {"ratio": ratio.median, "vllm": statistics.median(ratio.throughputs["vllm"])}

    def setup(self, cache) -> None:
        why = _vllm_missing()
        if why is not None:
            print(why)
            raise NotImplementedError(why)

    def track_paged_vllm_ratio(self, cache):
        return cache["ratio"]

    track_paged_vllm_ratio.unit = "x vLLM (higher is better)"  # type: ignore[attr-defined]

    def track_vllm_output_throughput(self, cache):
        return cache["vllm"]

    track_vllm_output_throughput.unit = "output tokens/s (higher is better)"  # type: ignore[attr-defined]


class KVBookkeeping:
    """Every policy's bookkeeping alone: 64 live sequences, 32 pages each, 64 replaced."""

    params = (["paged", "paged-lfu", "contiguous", "contiguous-defrag", "paged-mixed",
               "paged-mixed-migrate", "segmented", "vattention", "vattention-64k",
               "vattention-prewarm"],)
    param_names = ("engine",)
    timeout = 300
    number = 1  # a churn leaves the manager empty, but its sequences spent
    LIVE, PAGES, ROUNDS = 64, 32, 64

    def setup(self, engine: str) -> None:
        from benchmarks.kv_bookkeeping import manager, sequences

        self.kv = manager(engine, self.LIVE, self.PAGES)
        self.seqs = sequences(self.LIVE + self.ROUNDS, self.PAGES)

    def time_churn(self, engine: str) -> None:
        from benchmarks.kv_bookkeeping import churn

        churn(self.kv, self.seqs, self.LIVE, self.PAGES)


class Fidelity:
    """The median, over the stored check's workloads and loads, of the median per-request
    error of the kept structure of the step cost (``kvbench fidelity --resimulate``)."""

    params = (("ttft", "tpot"),)
    param_names = ("latency",)
    timeout = 600

    def setup_cache(self) -> dict[str, float] | None:
        import os
        import shutil
        import tempfile

        from kvbench.tools.fidelity.study import resimulate

        root = Path(__file__).resolve().parents[1]
        src = root / "results" / "fidelity" / "paged-cpu" / "real"
        if not (src / "plan.json").is_file():
            return None
        here = os.getcwd()
        os.chdir(root)  # the plan names its trace relative to the repository
        try:
            with tempfile.TemporaryDirectory() as tmp:
                shutil.copytree(src, Path(tmp) / "real")
                result = resimulate(Path(tmp), lambda _: None)
        finally:
            os.chdir(here)
        kept = [lv["forms"][result["form"]]["requests"]
                for wl in result["workloads"] for lv in wl["levels"]]
        return {k: statistics.median(e[k]["median_ape_pct"] for e in kept)
                for k in ("ttft", "tpot")}

    def setup(self, cache, latency: str) -> None:
        if cache is None:
            raise NotImplementedError("no stored real runs under results/fidelity/paged-cpu")

    def track_median_error_pct(self, cache, latency):
        return cache[latency]

    track_median_error_pct.unit = "%"
