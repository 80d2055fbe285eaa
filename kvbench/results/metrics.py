"""Summary metrics of a run: pure functions over the harness's timings, step log and
telemetry samples. Names follow ``vllm bench serve`` where they overlap.

Definitions (times in the run's clock; latencies measured from the request's arrival;
"busy steps" are steps where some KV is reserved; time-weighted means weight each step by
its duration):

Latency, per completed request, reported as ``mean_/median_/p90_/p99_<name>_ms``:

- ``ttft``: first output token time - arrival.
- ``tpot``: (e2el - ttft) / (output_tokens - 1), for requests with more than one output token.
- ``itl``: gaps between consecutive output-token emissions of a request, pooled over requests
  (in a run that ended early, requests still running count too).
- ``e2el``: finish - arrival.

Throughput and goodput:

- ``request_throughput`` / ``output_throughput`` / ``total_token_throughput``: completed
  requests, output tokens, prompt + output tokens of completed requests, per second of run.
- ``request_goodput``: completed requests meeting the SLO (``--slo ttft:MS,tpot:MS``) per
  second of run; ``slo_attainment_pct``: those requests as a share of all requests
  (rejected, failed and unfinished ones miss). Both None without an SLO.
- ``failed``: requests a served engine could not complete (HTTP errors, timeouts, dropped
  connections; each row's ``reason`` says which).

Concurrency:

- ``max_concurrent_requests``: most requests holding KV (running) after any step;
  ``mean_concurrent_requests``: its time-weighted mean.

KV memory (from the engine's KVStats after every step):

- ``mean_kv_utilization``: time-integral of KV used / time-integral of KV reserved, over busy
  steps. Used = slots holding written token states; reserved = slots handed to sequences.
- ``kv_waste_pct`` = 100 x (1 - mean_kv_utilization): reserved memory holding no KV, split
  into ``kv_reservation_waste_pct`` (slots reserved for tokens the sequences will still
  write: the rest of a paged sequence's last block up to its final length, the unwritten
  prompt and output room of a contiguous extent) and ``kv_internal_waste_pct`` (slots that
  will never hold KV: a last block's slots past the final token, an extent's room beyond
  prompt + output, reserved memory no sequence holds). Both shares are of reserved memory
  and sum to ``kv_waste_pct``; the split needs the engine's ``reserved_ahead_bytes``.
- ``min_frag_index`` / ``mean_frag_index``: minimum / time-weighted mean over steps of
  largest_free / free (1.0 when all free memory serves one allocation; steps with free
  memory only).
- ``kv_wait_s``: time of steps in which the KV manager refused to admit the request at the
  head of the waiting queue (requests are admitted FCFS, so everything behind it waited too).
  ``fragmentation_wait_steps`` / ``fragmentation_wait_s``: those steps, and their time, in
  which the free memory would have held the refused request in total (its footprint) but no
  hole, page run or size class did: external fragmentation. Free memory is read at the
  refusal, before the step's finished requests release theirs.
  ``fragmentation_wait_t_s``, ``_free_bytes``, ``_largest_free_bytes``, ``_need_bytes``: the
  worst such refusal (the most memory free; the first of equals): when its step started, the
  free memory, the largest hole and the request's footprint. None without a refusal of this
  kind, or where the engine does not report refusals.
- ``page_turnover_per_s``: block (paged) or extent (contiguous) allocations plus frees per
  second of run.
- ``prefix_hit_rate``: prompt tokens served from the prefix cache / prompt tokens looked up;
  ``shared_block_ratio``: time-integral of KV referenced by more than one sequence /
  time-integral of KV reserved, over busy steps.
- ``kv_retained_bytes``: KV still reserved after the run drained (0 unless blocks leak).
- ``peak_page_table_entries`` / ``mean_page_table_entries``: entries of the translation
  structures live sequences hold (block-table entries, extent descriptors, mapped pages),
  peak and time-weighted mean; ``peak_page_table_bytes`` at 8 bytes an entry.
- ``peak_kv_text_bytes``, ``peak_kv_image_bytes``, ``peak_kv_audio_bytes``: the peak over
  steps of the KV bytes the tokens of each modality held (generated tokens are text): tokens
  held x bytes per token at the dtype of the page class storing them (the codes; a quantised
  class's scales are a fixed side table, not counted), with ``kv_<modality>_dtype_bytes``
  that dtype's bytes per element. None where some step's used KV could not be attributed
  to modalities (KV shared between sequences, blocks released outside a sliding window).
- ``kv_copied_bytes``: KV bytes copied between slots over the run (copy-on-write,
  compaction, migration); ``kv_evictions``, ``kv_merges``, ``kv_splits``,
  ``kv_migrated_bytes``, ``kv_map_ops``, ``kv_unmap_ops``: counters of the policies that keep
  them (None for the others).

Process and device memory (telemetry; RSS and NVML readings are rate-limited, and are also
taken when warm-up ends and when the run ends):

- ``peak_rss_bytes``: the largest process RSS reading.
- ``peak_device_bytes``: the largest reading of this process's device memory from NVML, or
  where NVML cannot see the process, the CUDA allocator's reserved peak; None off CUDA.
- ``memory_growth_pct``: the larger of ``rss_growth_pct`` and ``device_growth_pct``, each
  100 x (reading at the end of the run - reading at the end of warm-up) / reading at the end
  of warm-up. Warm-up ends with the step that finishes the first 10% of the run's requests.

Modelled device memory (engines that model it, the simulator; see
:mod:`kvbench.engines.device_memory`), replacing the device metrics above:

- ``peak_device_bytes``: the largest step peak of the device's used memory (reserved by the
  caching allocator plus non-torch memory: what nvidia-smi would show), summed over
  tensor-parallel ranks (``peak_device_bytes_per_rank``: one rank's share, all ranks being
  alike); ``peak_device_allocated_bytes`` / ``peak_device_reserved_bytes``:
  the largest step peaks of live tensors / of the allocator's reservation.
- ``peak_device_<component>_bytes`` for weights, kv, activation, attention, encoder,
  kv_cached and workspace_cached (reserved by the allocator, held by no tensor: around the
  KV cache's tensors and around the step workspace) and non_torch: the components at the
  step of ``peak_device_bytes``; they sum to it.
- ``device_growth_pct`` of the used memory, as above, and ``memory_growth_pct`` equal to it:
  the simulator's own RSS (``peak_rss_bytes``, ``rss_growth_pct``) is a host metric.
- After an out-of-memory failure (a step, or the start-up, that does not fit a rank):
  ``device_oom_needed_bytes`` and ``device_oom_<component>_bytes``, what it needed per rank,
  ``device_oom_free_bytes``, what was free on the rank before it, and
  ``device_oom_memory_bytes``, the rank's memory.
- ``telemetry_overhead_pct``: wall time spent logging steps and reading probes, as a share
  of the wall time of steps (idle waits for arrivals excluded).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.engines.base import DeviceMemory
from kvbench.engines.device_memory import DeviceOutOfMemory
from kvbench.engines.kv.modality import MODALITIES
from kvbench.results.curves import device_columns, frag_index, fragmentation_waits
from kvbench.results.slo import SLO
from kvbench.run.gaps import weighted_stats
from kvbench.run.harness import EngineRun

PERCENTILES = (50, 90, 99)
# The curve modelled device metrics read.
MODELLED_DEVICE_CURVE = "device_used_bytes"


def _dist(prefix: str, values: list[float] | np.ndarray,
          weights: np.ndarray | None = None) -> dict[str, float | None]:
    """Mean, median and percentiles in ms of ``values`` (seconds), each counted
    ``weights[i]`` times when given."""
    keys = [f"mean_{prefix}_ms", f"median_{prefix}_ms"]
    keys += [f"p{p}_{prefix}_ms" for p in PERCENTILES if p != 50]
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    if weights is not None:
        got = weighted_stats(arr, weights, PERCENTILES)
        if got is None:
            return dict.fromkeys(keys)
        mean, percentiles = got
        return dict(zip(keys, [mean, *percentiles], strict=True))
    if not len(arr):
        return dict.fromkeys(keys)
    stats = [arr.mean(), np.median(arr)]
    stats += [np.percentile(arr, p) for p in PERCENTILES if p != 50]
    return {k: float(v) for k, v in zip(keys, stats, strict=True)}


def latency_samples(run: EngineRun) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2EL samples, in seconds (ITL: :func:`itl_samples`)."""
    ttft, tpot, e2el = [], [], []
    for t in run.timings.values():
        if t.finish_s is None or t.first_token_s is None:
            continue
        arrival = t.request.arrival_s
        ttft.append(t.first_token_s - arrival)
        e2el.append(t.finish_s - arrival)
        if t.tpot_s is not None:
            tpot.append(t.tpot_s)
    return {"ttft": ttft, "tpot": tpot, "e2el": e2el}


def itl_samples(run: EngineRun) -> tuple[np.ndarray, np.ndarray]:
    """The inter-token gaps of every request, pooled, in seconds, with how many times each
    counts: the length of each step, as many times as requests emitted in it following on
    from the step before, and the other gaps once each (:class:`~kvbench.run.gaps.GapLog`)."""
    s = run.steps
    dt = np.asarray(s.dt_s, dtype=np.float64)
    other = np.asarray(s.gaps.samples, dtype=np.float64)
    return (np.concatenate((dt, other)),
            np.concatenate((s.gaps.weights(len(dt)), np.ones(len(other), dtype=np.int64))))


def meets_slo(run: EngineRun, slo: SLO) -> int:
    """Number of requests that completed within every limit of ``slo``. A latency equal to
    its limit meets it: limits are compared with a relative slack of ``_SLO_SLACK`` so that
    rounding in clock arithmetic (0.5 s + 0.6 s is not exactly 1.1 s) decides nothing."""
    met = 0
    for t in run.timings.values():
        if t.finish_s is None or t.first_token_s is None:
            continue
        arrival = t.request.arrival_s
        limits = ((slo.ttft_ms, t.first_token_s - arrival), (slo.e2el_ms, t.finish_s - arrival),
                  (slo.tpot_ms, t.tpot_s))
        if all(limit is None or seconds is None or seconds * 1000.0 <= limit * (1 + _SLO_SLACK)
               for limit, seconds in limits):
            met += 1
    return met


_SLO_SLACK = 1e-9


def _weighted_mean(values: np.ndarray, weights: np.ndarray) -> float | None:
    total = float(weights.sum())
    return float((values * weights).sum() / total) if total > 0 else None


def summarize(run: EngineRun, slo: SLO | None = None) -> dict[str, Any]:
    timings = list(run.timings.values())
    completed = [t for t in timings if t.status == "ok"]
    rejected = sum(t.status == "rejected" for t in timings)
    failed = sum(t.status == "failed" for t in timings)
    duration = run.duration_s
    out_tokens = sum(t.output_tokens_emitted for t in timings)
    prompt_done = sum(t.request.prompt_tokens for t in completed)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)

    summary: dict[str, Any] = {
        "num_requests": len(timings),
        "completed": len(completed),
        "rejected": rejected,
        "failed": failed,
        "duration_s": duration,
        "wall_time_s": run.wall_time_s,
        "num_steps": len(run.steps),
        "request_throughput": rate(len(completed)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(
            prompt_done + sum(t.output_tokens_emitted for t in completed)
        ),
        "total_output_tokens": out_tokens,
        "request_goodput": None,
        "slo_attainment_pct": None,
    }
    if slo is not None:
        met = meets_slo(run, slo)
        summary["request_goodput"] = rate(met)
        summary["slo_attainment_pct"] = 100.0 * met / len(timings) if timings else None
    for name, values in latency_samples(run).items():
        summary.update(_dist(name, values))
    summary.update(_dist("itl", *itl_samples(run)))
    summary.update(kv_metrics(run))
    summary.update(fragmentation_metrics(run))
    summary.update(memory_metrics(run))
    summary.update(modal_metrics(run))
    summary.update(modality_metrics(run))
    return summary


def modality_metrics(run: EngineRun) -> dict[str, Any]:
    """Per modality of the tokens held (text, image, audio): the bytes per stored element of
    its dtype and the peak of its used KV bytes (tokens held x bytes per token at that dtype;
    :mod:`kvbench.engines.kv.modality`). None where some step's bytes could not be
    attributed to modalities (KV shared between sequences, ...) or the engine does not say;
    absent for engines that report no KV."""
    s = run.steps
    if not s.kv_modality_bytes:
        return {}
    out: dict[str, Any] = {}
    for m in MODALITIES:
        col = _full(s.kv_modality_bytes.get(m, []))
        facts = s.kv_modalities.get(m, {})
        out[f"kv_{m}_dtype_bytes"] = facts.get("element_bytes")
        out[f"peak_kv_{m}_bytes"] = int(col.max()) if col is not None else None
    return out


def modal_metrics(run: EngineRun) -> dict[str, Any]:
    """Encoder-cache memory and, for a pool of page classes (modality-aware KV), per class:
    bytes per stored element (its dtype's), peak reserved and used bytes, mean utilisation
    of its capacity (reserved / capacity: usage per pool, not the max of pools) and waste
    (1 - used / reserved over the steps, reserved-weighted). Only keys the run has."""
    s = run.steps
    out: dict[str, Any] = {}
    enc = s.kv_encoder_cache_bytes.present()
    if len(enc):
        out["peak_encoder_cache_bytes"] = int(enc.max())
        out["mean_encoder_cache_bytes"] = float(np.mean(enc))
    kv = run.last_kv
    if not s.kv_class_bytes or kv is None or kv.classes is None:
        return out
    for name, last in kv.classes.items():
        reserved = np.asarray(s.kv_class_bytes[f"{name}_reserved_bytes"], dtype=np.float64)
        used = np.asarray(s.kv_class_bytes[f"{name}_used_bytes"], dtype=np.float64)
        cap = np.asarray(s.kv_class_bytes[f"{name}_capacity_bytes"], dtype=np.float64)
        out[f"kv_{name}_element_bytes"] = last["element_bytes"]
        out[f"kv_{name}_page_tokens"] = last["page_tokens"]
        out[f"peak_kv_{name}_reserved_bytes"] = int(reserved.max(initial=0))
        out[f"peak_kv_{name}_used_bytes"] = int(used.max(initial=0))
        out[f"mean_kv_{name}_utilization"] = float(np.mean(reserved / np.maximum(cap, 1)))
        total = reserved.sum()
        out[f"kv_{name}_waste_pct"] = (
            100.0 * (1.0 - used.sum() / total) if total > 0 else None)
    return out


# KVStats counters that only some KV policies keep (None elsewhere), as summary kv_<name>.
POLICY_COUNTERS = ("evictions", "merges", "splits", "migrated_bytes", "map_ops", "unmap_ops")
# A page-table entry as an engine stores it: one 64-bit physical page number or descriptor.
PAGE_TABLE_ENTRY_BYTES = 8


def _full(values: list) -> np.ndarray | None:
    """A KVStats column as floats, or None when the engine left any step's value absent."""
    if not values or None in values:
        return None
    return np.asarray(values, dtype=np.float64)


def kv_metrics(run: EngineRun) -> dict[str, Any]:
    s = run.steps
    kv = run.last_kv
    out: dict[str, Any] = {
        "max_concurrent_requests": int(np.asarray(s.running).max(initial=0)),
        "mean_concurrent_requests": None,
        "preemptions": int(np.asarray(s.preempted).sum()),
        "kv_capacity_bytes": kv.capacity_bytes if kv else None,
        "peak_kv_reserved_bytes": None,
        "peak_kv_used_bytes": None,
        "mean_kv_utilization": None,
        "kv_waste_pct": None,
        "kv_reservation_waste_pct": None,
        "kv_internal_waste_pct": None,
        "min_frag_index": None,
        "mean_frag_index": None,
        "page_turnover_per_s": None,
        "prefix_hit_rate": None,
        "shared_block_ratio": None,
        "kv_retained_bytes": None,
        "peak_page_table_entries": None,
        "mean_page_table_entries": None,
        "peak_page_table_bytes": None,
        "kv_copied_bytes": kv.copied_bytes if kv else None,
        **{f"kv_{name}": getattr(kv, name) if kv else None for name in POLICY_COUNTERS},
    }
    if not len(s):
        return out
    dt = np.asarray(s.dt_s, dtype=np.float64)
    out["mean_concurrent_requests"] = _weighted_mean(np.asarray(s.running, np.float64), dt)
    reserved, used = _full(s.kv_reserved_bytes), _full(s.kv_used_bytes)
    if reserved is not None:
        out["peak_kv_reserved_bytes"] = int(reserved.max())
        busy = reserved > 0
        denom = float((reserved[busy] * dt[busy]).sum())
        if used is not None:
            out["peak_kv_used_bytes"] = int(used.max())
            if denom > 0:
                util = float((used[busy] * dt[busy]).sum()) / denom
                out["mean_kv_utilization"] = util
                out["kv_waste_pct"] = 100.0 * (1.0 - util)
                ahead = _full(s.kv_reserved_ahead_bytes)
                if ahead is not None:
                    res_waste = 100.0 * float((ahead[busy] * dt[busy]).sum()) / denom
                    out["kv_reservation_waste_pct"] = res_waste
                    out["kv_internal_waste_pct"] = out["kv_waste_pct"] - res_waste
        shared = _full(s.kv_shared_bytes)
        if shared is not None and denom > 0:
            out["shared_block_ratio"] = float((shared[busy] * dt[busy]).sum()) / denom
    entries = _full(s.page_table_entries)
    if entries is not None:
        out["peak_page_table_entries"] = int(entries.max())
        out["mean_page_table_entries"] = _weighted_mean(entries, dt)
        out["peak_page_table_bytes"] = int(entries.max()) * PAGE_TABLE_ENTRY_BYTES
    free, largest = _full(s.kv_free_bytes), _full(s.kv_largest_free_bytes)
    if free is not None and largest is not None:
        mask = free > 0
        if mask.any():
            frag = frag_index(free[mask], largest[mask])
            out["min_frag_index"] = float(frag.min())
            out["mean_frag_index"] = _weighted_mean(frag, dt[mask])
    if kv is not None:
        if kv.block_allocs is not None and kv.block_frees is not None and run.duration_s > 0:
            out["page_turnover_per_s"] = (kv.block_allocs + kv.block_frees) / run.duration_s
        if kv.prefix_query_tokens:
            out["prefix_hit_rate"] = (kv.prefix_hit_tokens or 0) / kv.prefix_query_tokens
        if run.status == "ok":
            out["kv_retained_bytes"] = kv.reserved_bytes
    return out


FRAGMENTATION_WORST = ("t_s", "free_bytes", "largest_free_bytes", "need_bytes")


def fragmentation_metrics(run: EngineRun) -> dict[str, Any]:
    s = run.steps
    out: dict[str, Any] = {
        "kv_wait_s": None, "fragmentation_wait_steps": None, "fragmentation_wait_s": None,
        **{f"fragmentation_wait_{name}": None for name in FRAGMENTATION_WORST},
    }
    need, free = _full(s.kv_refused_bytes), _full(s.kv_refused_free_bytes)
    largest = _full(s.kv_refused_largest_free_bytes)
    if need is None or free is None or largest is None:
        return out
    dt = np.asarray(s.dt_s, dtype=np.float64)
    waits = fragmentation_waits(need, free)
    out["kv_wait_s"] = float(dt[need > 0].sum())
    out["fragmentation_wait_steps"] = int(waits.sum())
    out["fragmentation_wait_s"] = float(dt[waits].sum())
    if waits.any():
        # argmax keeps the first of equal maxima.
        i = int(np.argmax(np.where(waits, free, -1.0)))
        worst = (s.t_s[i] - s.dt_s[i], int(free[i]), int(largest[i]), int(need[i]))
        out.update(zip((f"fragmentation_wait_{n}" for n in FRAGMENTATION_WORST), worst,
                       strict=True))
    return out


def _growth_pct(start: float | None, end: float | None) -> float | None:
    if start is None or end is None or start <= 0:
        return None
    return 100.0 * (end - start) / start


def _reading_at(steps: list[int], values: list[int], step: int) -> int | None:
    """The last reading taken at or before ``step``."""
    i = int(np.searchsorted(np.asarray(steps), step, side="right")) - 1
    return values[i] if i >= 0 else None


def device_series(run: EngineRun) -> tuple[str, list[int], list[int]] | None:
    """This process's device memory readings: (source, step indices, bytes)."""
    tel = run.telemetry
    if tel is None:
        return None
    nvml = tel.samples.get("nvml")
    if nvml is not None and "nvml_process_used_bytes" in nvml.columns and nvml.rows:
        return "nvml_process_used_bytes", nvml.steps, nvml.column("nvml_process_used_bytes")
    cuda = tel.samples.get("cuda")
    if cuda is not None and cuda.rows:
        return "cuda_reserved_bytes", cuda.steps, cuda.column("cuda_reserved_bytes")
    return None


def memory_metrics(run: EngineRun) -> dict[str, Any]:
    out = measured_memory_metrics(run)
    out.update(modelled_device_metrics(run))
    if run.out_of_memory is not None:
        out.update(out_of_memory_metrics(run.out_of_memory))
    return out


def measured_memory_metrics(run: EngineRun) -> dict[str, Any]:
    """Process and device memory as the telemetry probes read it."""
    out: dict[str, Any] = {
        "peak_rss_bytes": None,
        "peak_device_bytes": None,
        "peak_cuda_allocated_bytes": None,
        "peak_cuda_reserved_bytes": None,
        "peak_cuda_inactive_split_bytes": None,
        "cuda_alloc_retries": None,
        "rss_growth_pct": None,
        "device_growth_pct": None,
        "memory_growth_pct": None,
        "telemetry_overhead_pct": None,
    }
    if run.step_wall_s > 0:
        out["telemetry_overhead_pct"] = 100.0 * run.telemetry_wall_s / run.step_wall_s
    tel = run.telemetry
    if tel is None:
        return out
    warm, end = run.warmup_step, len(run.steps) - 1
    rss = tel.samples.get("rss")
    if rss is not None and rss.rows:
        values = rss.column("rss_bytes")
        out["peak_rss_bytes"] = max(values)
        if warm is not None:
            out["rss_growth_pct"] = _growth_pct(
                _reading_at(rss.steps, values, warm), _reading_at(rss.steps, values, end)
            )
    cuda = tel.samples.get("cuda")
    if cuda is not None and cuda.rows:
        last = cuda.last()
        out["peak_cuda_allocated_bytes"] = last["cuda_peak_allocated_bytes"]
        out["peak_cuda_reserved_bytes"] = last["cuda_peak_reserved_bytes"]
        out["peak_cuda_inactive_split_bytes"] = max(cuda.column("cuda_inactive_split_bytes"))
        out["cuda_alloc_retries"] = last["cuda_alloc_retries"]
    device = device_series(run)
    if device is not None:
        source, steps, values = device
        out["peak_device_bytes"] = (
            max(values) if source.startswith("nvml") else out["peak_cuda_reserved_bytes"]
        )
        if warm is not None:
            out["device_growth_pct"] = _growth_pct(
                _reading_at(steps, values, warm), _reading_at(steps, values, end)
            )
    growth = [g for g in (out["rss_growth_pct"], out["device_growth_pct"]) if g is not None]
    out["memory_growth_pct"] = max(growth) if growth else None
    return out


def modelled_device_metrics(run: EngineRun) -> dict[str, Any]:
    """Device metrics of an engine that models its device's memory (the simulator), in
    place of measured ones; empty for the others. Host RSS stays a host metric."""
    cols = device_columns(run.steps)
    if not cols:
        return {}
    used = cols[MODELLED_DEVICE_CURVE]
    at = int(np.argmax(used))
    out: dict[str, Any] = {
        "peak_device_bytes": int(used[at]),
        "peak_device_bytes_per_rank": int(used[at]) // run.steps.device_ranks,
        "peak_device_allocated_bytes": int(cols["device_allocated_bytes"].max()),
        "peak_device_reserved_bytes": int(cols["device_reserved_bytes"].max()),
        **{f"peak_device_{name}_bytes": int(cols[f"device_{name}_bytes"][at])
           for name in DeviceMemory.COMPONENTS},
        "device_growth_pct": None,
    }
    if run.warmup_step is not None:
        out["device_growth_pct"] = _growth_pct(float(used[run.warmup_step]), float(used[-1]))
    # The simulator's own RSS says nothing about the simulated device.
    out["memory_growth_pct"] = out["device_growth_pct"]
    return out


def out_of_memory_metrics(oom: DeviceOutOfMemory) -> dict[str, Any]:
    """Per rank: what the failing step (or start-up) needed, by component, and what was
    free before it."""
    tp = oom.needed.tp
    return {
        "device_oom_needed_bytes": oom.needed_bytes,
        "device_oom_free_bytes": oom.free_bytes,
        "device_oom_memory_bytes": oom.memory_bytes,
        **{f"device_oom_{name}_bytes": value // tp
           for name, value in oom.needed.components().items()},
    }
