"""Leak detection over soak waves: what memory stayed after each wave drained, its growth
per wave (least-squares slope) and the verdict.

Rules. KV reserved after a drain is deterministic (the same waves through the same
scheduler), so any growth is a leak: flagged when the fitted slope is positive and the last
wave retains more than the first. Process and device readings are noisy (allocator caches,
lazily touched pages, the benchmark's own logs), so they count as leaking only when the
fitted growth over the soak, slope x (waves - 1), exceeds both ``noise_pct`` percent of the
reading after the first wave and ``noise_bytes``. The first wave is the warm-up: growth is
measured from its end.
"""

from __future__ import annotations

import numpy as np

from kvbench.results.runlog import EngineRun
from kvbench.results.schema import LeakFit, SoakResult, WaveMemory

KV_KIND = "kv_reserved_bytes"
# Memory kinds read after each drain: the KV snapshot plus these probe columns, if measured.
PROBE_KINDS = (
    "rss_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes", "nvml_device_used_bytes",
    "nvml_process_used_bytes",
)
DEFAULT_NOISE_PCT = 10.0
DEFAULT_NOISE_BYTES = 64 * 2**20


def slope_per_wave(values: list[float]) -> float:
    """Least-squares slope of ``values`` against wave number (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    x = np.arange(len(values), dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def fit_kind(kind: str, values: list[float], noise_pct: float, noise_bytes: float) -> LeakFit:
    slope = slope_per_wave(values)
    growth = slope * (len(values) - 1)
    first, last = values[0], values[-1]
    if first > 0:
        pct: float | None = 100.0 * (last - first) / first
    else:
        pct = 0.0 if last == first else None
    if kind == KV_KIND:
        threshold, leak = None, slope > 0 and last > first
    else:
        threshold = max(noise_pct / 100.0 * first, noise_bytes)
        leak = growth > threshold
    return LeakFit(
        bytes_per_wave=slope, growth_bytes=growth, growth_pct=pct, threshold_bytes=threshold,
        leak=leak,
    )


def wave_memory(run: EngineRun) -> list[WaveMemory]:
    """One row per drained wave: KV reserved and the probe readings taken at the drain."""
    rows = []
    # Timings hold the waves in order, one workload's worth each.
    timings, n = list(run.timings.values()), len(run.workload.requests)
    for k, end in enumerate(run.wave_ends):
        memory = {kind: end.memory[kind] for kind in PROBE_KINDS if kind in end.memory}
        if end.kv is not None and end.kv.reserved_bytes is not None:
            memory[KV_KIND] = end.kv.reserved_bytes
        done = sum(t.status == "ok" for t in timings[k * n : (k + 1) * n])
        rows.append(WaveMemory(wave=k + 1, t_s=end.t_s, completed=done, memory=memory))
    return rows


def analyze_soak(
    run: EngineRun,
    noise_pct: float = DEFAULT_NOISE_PCT,
    noise_bytes: int = DEFAULT_NOISE_BYTES,
) -> SoakResult:
    per_wave = wave_memory(run)
    kinds = [
        k for k in (KV_KIND, *PROBE_KINDS) if per_wave and all(k in w.memory for w in per_wave)
    ]
    fits = {
        k: fit_kind(k, [w.memory[k] for w in per_wave], noise_pct, noise_bytes) for k in kinds
    }
    findings = []
    for kind, fit in fits.items():
        if fit.leak:
            pct = "" if fit.growth_pct is None else f" ({fit.growth_pct:+.0f}% since wave 1)"
            findings.append(
                f"{kind.removesuffix('_bytes')} grows {fit.bytes_per_wave / 2**20:.2f} MiB "
                f"per wave{pct}"
            )
    if run.status != "ok":
        findings.append(
            f"the soak stopped after {len(per_wave)} of {run.waves} waves: {run.status}"
        )
    growths = [f.growth_pct for f in fits.values() if f.growth_pct is not None]
    return SoakResult(
        waves=run.waves,
        waves_completed=len(per_wave),
        noise_pct=noise_pct,
        noise_bytes=noise_bytes,
        per_wave=per_wave,
        fits=fits,
        leak_bytes_per_wave={k: f.bytes_per_wave for k, f in fits.items()},
        memory_growth_pct=max(growths) if growths else None,
        leak_detected=any(f.leak for f in fits.values()),
        findings=findings,
    )
