"""Calibration: time the torch executor's real steps over a grid of batch shapes, fit the cost
model's coefficients for that device, and keep both as a profile the sim can load
(``--device sim:PROFILE.json``).

Each grid point is one step of ``batch`` sequences, each computing ``chunk`` new tokens on
top of ``context`` tokens (on average) already in KV (``chunk == 1``: a decode). Points are
timed in rounds, every point once per round, so that slow drift in machine load hits all
points alike; a point's time is the median of its rounds after a warm-up round. A fixed
pseudo-random quarter of the points is held out of the fit: each structure of the step cost
(:data:`~kvbench.tools.calibrate.fit.FORMS`) is fitted on the rest, the one that predicts
them best is kept, and the profile reports its error on them.
"""

from __future__ import annotations

import datetime as dt
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from kvbench.engines.builtin.executor import Executor, ScheduledBatch, ScheduledSeq
from kvbench.engines.kv.base import KVManager
from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import Hardware
from kvbench.errors import KvbenchError
from kvbench.tools.calibrate.fit import best_form, features, holdout_mask, summarize
from kvbench.tools.calibrate.profile import Profile, ProfilePoint

_BLOCK_SIZE = 16



@dataclass(frozen=True, slots=True)
class GridPoint:
    batch: int  # sequences in the step
    context: int  # tokens a sequence already has in KV, on average (see _context_of)
    chunk: int  # new tokens per sequence (1: decode)


@dataclass(frozen=True, slots=True)
class Grid:
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]
    max_tokens: int  # largest step (batch x chunk), as max_num_batched_tokens bounds it
    repeats: int = 5
    holdout_every: int = 4  # 1 / the fraction of points held out of the fit

    def points(self) -> list[GridPoint]:
        return [
            GridPoint(b, c, k)
            for b, c, k in itertools.product(self.batch_sizes, self.contexts, self.chunks)
            if b * k <= self.max_tokens
        ]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# Sized for the tiny model on two CPU cores: one to two minutes of timing.
CPU_GRID = Grid(
    batch_sizes=(1, 4, 16, 32), contexts=(0, 256, 1024, 2048), chunks=(1, 32, 256, 1024),
    max_tokens=2048,
)
# Real GPU shapes: decode batches up to 256 and prefill chunks up to 8192 tokens.
CUDA_GRID = Grid(
    batch_sizes=(1, 8, 32, 128, 256), contexts=(0, 512, 2048, 8192), chunks=(1, 64, 512, 2048),
    max_tokens=8192,
)




def calibrate(
    preset: ModelPreset,
    device: str,
    grid: Grid,
    *,
    command: str,
    on_point: Callable[[int, int], None] | None = None,
) -> Profile:
    """Profile ``preset`` on torch ``device`` ("cpu", "cuda", "cuda:N") over ``grid`` and fit."""
    import torch

    from kvbench.engines.builtin.torch_executor import TorchExecutor
    from kvbench.results.machine import machine_info

    points = grid.points()
    if not points:
        raise KvbenchError("the calibration grid has no point within max_tokens")
    executor = TorchExecutor(preset, device=device)
    kind = "cuda" if executor.device.startswith("cuda") else "cpu"
    if kind == "cuda":
        from kvbench.run.devices import parse_device

        hardware = parse_device(executor.device).hardware
        source = f"datasheet figures of {hardware.name}"
    else:
        hardware = measure_cpu_peaks(preset.dtype)
        source = "measured on this CPU: torch copy bandwidth and matmul FLOP/s"
    kv = _kv_manager(preset, points)
    executor.bind(kv)
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    batches = [_batch(kv, preset, p, i) for i, p in enumerate(points)]
    samples: list[list[float]] = [[] for _ in points]
    cpu_samples: list[list[float]] = [[] for _ in points]
    total = (grid.repeats + 1) * len(points)
    try:
        rounds = itertools.product(range(grid.repeats + 1), enumerate(batches))
        for done, (rnd, (i, (batch, _shape))) in enumerate(rounds, 1):
            wall, cpu = _time_step(executor, kv, batch, sync)
            if rnd:  # round 0 warms caches and allocator pools
                samples[i].append(wall)
                cpu_samples[i].append(cpu)
            if on_point is not None:
                on_point(done, total)
    finally:
        executor.close()

    cost = CostModel(preset, hardware)
    x = np.array([features(cost, shape) for _b, shape in batches])
    t = np.array([statistics.median(s) for s in samples])
    held = holdout_mask(len(points), grid.holdout_every)
    form, coef, form_errors = best_form(x, t, held)
    fitted = CostModel(preset, replace(hardware, coef=coef))
    rows = [
        ProfilePoint(
            batch=p.batch, context=p.context, chunk=p.chunk, held_out=bool(h),
            measured_s=float(m), samples_s=s, cpu_samples_s=c,
            predicted_s=fitted.step_time_s(shape),
        )
        for p, h, m, s, c, (_b, shape) in zip(
            points, held, t, samples, cpu_samples, batches, strict=True
        )
    ]
    return Profile(
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        command=command, device=executor.device, device_kind=kind, model=preset.name,
        dtype=preset.dtype, attention=executor.kernels.name,
        torch_threads=torch.get_num_threads(), machine=machine_info(),
        hardware=replace(hardware, coef=coef).to_json(), hardware_source=source,
        grid=grid.to_json(), points=rows,
        fit=summarize(rows).model_copy(update={"form": form.name, "form_errors_pct": form_errors}),
    )


def measure_cpu_peaks(dtype: str, repeats: int = 5) -> Hardware:
    """Copy bandwidth and matmul throughput of this CPU with torch's threads: the ceilings the
    fitted efficiencies are relative to."""
    import torch

    from kvbench.engines.builtin.torch_device import TORCH_DTYPES
    from kvbench.engines.sim.hardware import CPU_HARDWARE

    src = torch.ones(32 * 2**20 // 4)  # 32 MiB: past the caches
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: dst.copy_(src), repeats)
    n = 1024
    a = torch.randn(n, n, dtype=TORCH_DTYPES[dtype])
    b = torch.randn(n, n, dtype=TORCH_DTYPES[dtype])
    mm_s = _median_time(lambda: torch.mm(a, b), repeats)
    return replace(
        CPU_HARDWARE,
        hbm_bytes_per_s=2 * src.nbytes / copy_s,  # read + write
        flops_per_s=2 * n**3 / mm_s,
    )


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _kv_manager(preset: ModelPreset, points: list[GridPoint]) -> KVManager:
    from kvbench.engines.kv.paged import PagedKVManager

    # Room for the largest point's sequences (each point's are freed before the next).
    need = max(
        sum(-(-(_context_of(p, j) + p.chunk + 1) // _BLOCK_SIZE) for j in range(p.batch))
        for p in points
    )
    max_len = max(_context_of(p, p.batch - 1) + p.chunk + 1 for p in points)
    return PagedKVManager(
        need, _BLOCK_SIZE, preset.kv_bytes_per_token, max_len, enable_prefix_caching=False
    )


def _context_of(point: GridPoint, j: int) -> int:
    """Context of sequence ``j`` of ``point``: spread evenly from half to 1.5 times the
    point's context, mean unchanged. Real batches mix lengths, and a kernel that pads every
    sequence to the longest must be timed doing so."""
    if point.batch == 1:
        return point.context
    return round(point.context * (0.5 + j / (point.batch - 1)))


def _batch(kv: KVManager, preset: ModelPreset, point: GridPoint, index: int):
    """One step of ``point``'s shape over fresh sequences (holding no KV yet) and its shape."""
    from kvbench.engines.builtin.engine import batch_shape
    from kvbench.engines.sequence import Sequence
    from kvbench.workloads.model import Request, Segment

    items = []
    for j in range(point.batch):
        context = _context_of(point, j)
        decode = point.chunk == 1 and context > 0
        prompt = context if decode else context + point.chunk
        req = Request(f"cal{index}-{j}", 0.0, (Segment("text", prompt, f"cal{index}-{j}"),), 2)
        seq = Sequence(j, req, req.prompt_token_ids(preset.vocab_size))
        if decode:
            seq.output_ids.append(1)  # a decode: its last token was sampled, not prompted
        items.append(ScheduledSeq(seq, context, point.chunk, True))
    batch = ScheduledBatch(items)
    return batch, batch_shape(batch, kv.bytes_per_token)


def _time_step(executor: Executor, kv: KVManager, batch: ScheduledBatch,
               sync: Callable[[], object]) -> tuple[float, float]:
    """Wall and process CPU seconds of one ``execute`` of ``batch``; its sequences hold KV
    blocks only meanwhile, so the pool needs room for one point's sequences, not the whole
    grid's."""
    for item in batch.items:
        kv.allocate(item.seq, 0, item.start + item.num_tokens)
        item.seq.num_computed_tokens = item.start
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    executor.execute(batch, kv)
    sync()
    elapsed = time.perf_counter() - t0, time.process_time() - c0
    for item in batch.items:
        kv.free(item.seq)
    return elapsed
