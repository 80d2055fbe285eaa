"""Calibration: time the torch executor's real steps over a grid of batch shapes, fit the cost
model's coefficients for that device, and keep both as a profile the sim can load
(``--device sim:PROFILE.json``).

Each grid point is one step of ``batch`` sequences, each computing ``chunk`` new tokens on
top of ``context`` tokens (on average) already in KV (``chunk == 1``: a decode). Points are
timed in rounds, every point once per round, so that slow drift in machine load hits all
points alike; a point's time is the median of its rounds after a warm-up round. A fixed
pseudo-random quarter of the points is held out of the fit, and the profile reports the
fitted model's error on them.

The fit keeps the cost model's roofline form with attention as its own operator
(``CostCoefficients.split_attention``): fixed costs per step and per sequence, plus a
roofline for the linear layers and one for attention. Which side of each max binds is
decided per point, alternating with a bounded linear least-squares fit of relative error
(efficiencies at most 1, fixed costs at least 0) until no point changes side.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvbench.engines.base import BatchShape
from kvbench.engines.costmodel import CostModel
from kvbench.engines.executor import Executor, ScheduledBatch, ScheduledSeq
from kvbench.engines.kv.base import KVManager
from kvbench.engines.presets import ModelPreset
from kvbench.errors import InputFileError, KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.hardware import CostCoefficients, Hardware
from kvbench.workloads.validation import validation_message

PROFILE_VERSION = 1
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfilePoint(_Strict):
    batch: int = Field(ge=1)
    context: int = Field(ge=0)
    chunk: int = Field(ge=1)
    held_out: bool
    measured_s: float = Field(gt=0)  # median over rounds
    samples_s: list[float]
    # Process CPU seconds of the same steps: wall / CPU shows how much of a step was spent
    # waiting for a core on a busy machine (or, above 1 thread, CPU spent in parallel).
    cpu_samples_s: list[float]
    predicted_s: float

    @property
    def error_pct(self) -> float:
        return 100 * (self.predicted_s - self.measured_s) / self.measured_s


class FitSummary(_Strict):
    """Absolute relative errors of the fitted model, in percent."""

    train_points: int
    heldout_points: int
    train_median_err_pct: float
    heldout_median_err_pct: float
    heldout_p90_err_pct: float
    heldout_max_err_pct: float
    median_wall_over_cpu: float  # over all samples


class Profile(_Strict):
    kvbench_profile: Literal[1] = PROFILE_VERSION
    created_utc: str
    command: str
    device: str  # the torch device measured, e.g. "cpu" or "cuda:0"
    device_kind: Literal["cpu", "cuda"]
    model: str
    dtype: str
    attention: str
    torch_threads: int  # step times depend on it: simulate runs that use as many
    machine: dict[str, Any]
    # Peak figures the coefficients are relative to, with the fitted coefficients ("coef").
    hardware: dict[str, Any]
    hardware_source: str
    grid: dict[str, Any]
    points: list[ProfilePoint]
    fit: FitSummary

    def hardware_spec(self) -> Hardware:
        return Hardware.from_json(self.hardware)

    def coefficients(self) -> CostCoefficients:
        return self.hardware_spec().coef


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KvbenchError(
            f"no calibration profile at {path}: write one with kvbench calibrate -o {path}"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputFileError(path, f"not a readable JSON profile: {exc}") from None
    try:
        profile = Profile.model_validate(data)
        profile.hardware_spec()
    except ValidationError as exc:
        msg = validation_message(exc)
        raise InputFileError(path, f"invalid calibration profile: {msg}") from None
    except (TypeError, KvbenchError) as exc:
        raise InputFileError(path, f"invalid hardware section: {exc}") from None
    return profile


def save_profile(profile: Profile, path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(profile.model_dump(), indent=1) + "\n")


# --- fitting ---------------------------------------------------------------------------------

# Fitted parameters: fixed costs per step and per sequence, then 1 / efficiency for
# linear-layer FLOPs and bytes and attention FLOPs and bytes. The lower bounds say that no
# step beats the peak figures. (A per-token cost would be collinear with the linear layers'
# FLOPs, so there is none.)
_NUM_PARAMS = 6
_LOWER = np.array([0.0, 0.0, 1.0, 1.0, 1.0, 1.0])


def features(cost: CostModel, shape: BatchShape) -> np.ndarray:
    """[1, seqs, then seconds at peak of: linear-layer FLOPs, weight and copy bytes,
    attention FLOPs (masked ones included), KV bytes] of one step."""
    r = cost.terms(shape)
    peak_flops, peak_bw = cost.hardware.flops_per_s, cost.hardware.hbm_bytes_per_s
    return np.array([
        1.0, shape.num_seqs,
        (r.flops - r.attention_flops) / peak_flops, (r.nbytes - r.kv_bytes) / peak_bw,
        (r.attention_flops + r.masked_attention_flops) / peak_flops, r.kv_bytes / peak_bw,
    ])


def fit_coefficients(x: np.ndarray, t: np.ndarray) -> CostCoefficients:
    """Least relative-squared-error coefficients (split-attention form) for features ``x``
    (rows from :func:`features`) and measured step times ``t``.

    Which side of each max binds is fixed per point, the rest is a linear fit; the two
    alternate until no point changes side. Starting sides: as measured at peak figures, and
    each uniform choice; the best end wins.
    """
    if len(t) < _NUM_PARAMS:
        raise KvbenchError(f"a fit needs at least {_NUM_PARAMS} points, got {len(t)}")
    n = len(t)
    starts = [(x[:, 2] >= x[:, 3], x[:, 4] >= x[:, 5])] + [
        (np.full(n, a), np.full(n, b)) for a in (True, False) for b in (True, False)
    ]
    best: tuple[float, np.ndarray] | None = None
    for linear, attention in starts:
        for _ in range(50):
            a = np.column_stack([
                x[:, 0], x[:, 1], x[:, 2] * linear, x[:, 3] * ~linear,
                x[:, 4] * attention, x[:, 5] * ~attention,
            ])
            p = _bounded_lstsq(a / t[:, None], np.ones(n), _LOWER)
            sides = (p[2] * x[:, 2] >= p[3] * x[:, 3], p[4] * x[:, 4] >= p[5] * x[:, 5])
            if (sides[0] == linear).all() and (sides[1] == attention).all():
                break
            linear, attention = sides
        loss = float(np.sum((_predict(p, x) / t - 1) ** 2))
        if best is None or loss < best[0]:
            best = (loss, p)
    assert best is not None
    p = best[1]
    return CostCoefficients(
        flops_efficiency=float(1 / p[2]), bandwidth_efficiency=float(1 / p[3]),
        overhead_s=float(p[0]), per_seq_s=float(p[1]),
        attention_flops_efficiency=float(1 / p[4]),
        attention_bandwidth_efficiency=float(1 / p[5]),
    )


def _predict(p: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (
        x[:, :2] @ p[:2]
        + np.maximum(p[2] * x[:, 2], p[3] * x[:, 3])
        + np.maximum(p[4] * x[:, 4], p[5] * x[:, 5])
    )


def _bounded_lstsq(a: np.ndarray, b: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """argmin |a p - b| subject to p >= lower, exactly, by trying every set of parameters
    left free (the rest at their bound): six parameters make 64 small solves."""
    n = a.shape[1]
    rhs = b - a @ lower
    best_loss, best = float(np.sum(rhs**2)), lower.copy()
    for mask in range(1, 1 << n):
        free = [j for j in range(n) if mask >> j & 1]
        sol = np.linalg.lstsq(a[:, free], rhs, rcond=None)[0]
        if (sol < 0).any():
            continue
        p = lower.copy()
        p[free] += sol
        loss = float(np.sum((a @ p - b) ** 2))
        if loss < best_loss:
            best_loss, best = loss, p
    return best


def holdout_mask(n: int, every: int) -> np.ndarray:
    """A fixed pseudo-random ``1/every`` of ``n`` points; a plain stride would line up with a
    grid axis (every 4th point of a 4-chunk grid is the largest chunk)."""
    held = np.zeros(n, bool)
    held[np.random.default_rng(0).permutation(n)[: n // every]] = True
    return held


def summarize(points: list[ProfilePoint]) -> FitSummary:
    train = [abs(p.error_pct) for p in points if not p.held_out]
    held = [abs(p.error_pct) for p in points if p.held_out] or [float("nan")]
    ratios = [
        w / c for p in points for w, c in zip(p.samples_s, p.cpu_samples_s, strict=True) if c > 0
    ]
    return FitSummary(
        train_points=len(train), heldout_points=sum(p.held_out for p in points),
        train_median_err_pct=statistics.median(train),
        heldout_median_err_pct=statistics.median(held),
        heldout_p90_err_pct=float(np.percentile(held, 90)),
        heldout_max_err_pct=max(held),
        median_wall_over_cpu=statistics.median(ratios) if ratios else float("nan"),
    )


# --- measuring -------------------------------------------------------------------------------


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

    from kvbench.engines.torch_executor import TorchExecutor
    from kvbench.machine import machine_info

    points = grid.points()
    if not points:
        raise KvbenchError("the calibration grid has no point within max_tokens")
    executor = TorchExecutor(preset, device=device)
    kind = "cuda" if executor.device.startswith("cuda") else "cpu"
    if kind == "cuda":
        from kvbench.devices import parse_device

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
    coef = fit_coefficients(x[~held], t[~held])
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
        grid=grid.to_json(), points=rows, fit=summarize(rows),
    )


def measure_cpu_peaks(dtype: str, repeats: int = 5) -> Hardware:
    """Copy bandwidth and matmul throughput of this CPU with torch's threads: the ceilings the
    fitted efficiencies are relative to."""
    import torch

    from kvbench.devices import CPU_HARDWARE
    from kvbench.engines.torch_device import TORCH_DTYPES

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
    from kvbench.engines.builtin import batch_shape
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
