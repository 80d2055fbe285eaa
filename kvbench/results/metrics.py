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
:mod:`kvbench.engines.sim.device_memory`), replacing the device metrics above:

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
from kvbench.engines.kv.modality import MODALITIES
from kvbench.engines.sim.device_memory import DeviceOutOfMemory
from kvbench.results.slo import SLO
from kvbench.run.gaps import weighted_stats
from kvbench.run.harness import EngineRun
from kvbench.run.stepstats import StepSums, device_used_at, run_sums

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


def itl_samples(run: EngineRun, sums: StepSums | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The inter-token gaps of every request, pooled, in seconds, with how many times each
    counts: the length of each step, as many times as requests emitted in it following on
    from the step before, and the other gaps once each (:class:`~kvbench.run.gaps.GapLog`).
    ``sums``: the step log's reductions, if already made."""
    values, weights = (sums or run_sums(run.steps)).gaps
    other = np.asarray(run.steps.gaps.samples, dtype=np.float64)
    return (np.concatenate((values, other)),
            np.concatenate((weights, np.ones(len(other), dtype=np.int64))))


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
        # Far less sensitive to other load on the machine than the wall-clock rate.
        "output_throughput_per_cpu_s": (out_tokens / run.engine_cpu_s
                                        if run.engine_cpu_s else None),
        "request_goodput": None,
        "slo_attainment_pct": None,
    }
    if slo is not None:
        met = meets_slo(run, slo)
        summary["request_goodput"] = rate(met)
        summary["slo_attainment_pct"] = 100.0 * met / len(timings) if timings else None
    sums = run_sums(run.steps)
    for name, values in latency_samples(run).items():
        summary.update(_dist(name, values))
    summary.update(_dist("itl", *itl_samples(run, sums)))
    summary.update(kv_metrics(run, sums))
    summary.update(fragmentation_metrics(sums))
    summary.update(memory_metrics(run, sums))
    summary.update(modal_metrics(run, sums))
    summary.update(modality_metrics(run, sums))
    return summary


def modality_metrics(run: EngineRun, sums: StepSums) -> dict[str, Any]:
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
        peak = sums.max.get(f"modality:{m}")
        out[f"kv_{m}_dtype_bytes"] = s.kv_modalities.get(m, {}).get("element_bytes")
        out[f"peak_kv_{m}_bytes"] = (
            int(peak) if peak is not None and f"modality:{m}" not in sums.missing else None)
    return out


def modal_metrics(run: EngineRun, sums: StepSums) -> dict[str, Any]:
    """Encoder-cache memory and, for a pool of page classes (modality-aware KV), per class:
    bytes per stored element (its dtype's), peak reserved and used bytes, mean utilisation
    of its capacity (reserved / capacity: usage per pool, not the max of pools) and waste
    (1 - used / reserved over the steps, reserved-weighted). Only keys the run has."""
    out: dict[str, Any] = {}
    if sums.count.get("encoder"):
        out["peak_encoder_cache_bytes"] = int(sums.max["encoder"])
        out["mean_encoder_cache_bytes"] = sums.sum["encoder"] / sums.count["encoder"]
    kv = run.last_kv
    if not run.steps.kv_class_bytes or kv is None or kv.classes is None:
        return out
    for name, last in kv.classes.items():
        out[f"kv_{name}_element_bytes"] = last["element_bytes"]
        out[f"kv_{name}_page_tokens"] = last["page_tokens"]
        steps = sums.count.get(f"class:{name}", 0)
        out[f"peak_kv_{name}_reserved_bytes"] = int(sums.max.get(f"class:{name}:reserved", 0))
        out[f"peak_kv_{name}_used_bytes"] = int(sums.max.get(f"class:{name}:used", 0))
        out[f"mean_kv_{name}_utilization"] = (
            sums.sum[f"class:{name}:util"] / steps if steps else None)
        total = sums.sum.get(f"class:{name}:reserved", 0.0)
        out[f"kv_{name}_waste_pct"] = (
            100.0 * (1.0 - sums.sum[f"class:{name}:used"] / total) if total > 0 else None)
    return out


# KVStats counters that only some KV policies keep (None elsewhere), as summary kv_<name>.
POLICY_COUNTERS = ("evictions", "merges", "splits", "migrated_bytes", "map_ops", "unmap_ops")
# A page-table entry as an engine stores it: one 64-bit physical page number or descriptor.
PAGE_TABLE_ENTRY_BYTES = 8


def _ratio(sums: StepSums, key: str, denom: float) -> float | None:
    value = sums.sum.get(key)
    return value / denom if value is not None and denom > 0 else None


def kv_metrics(run: EngineRun, sums: StepSums) -> dict[str, Any]:
    kv = run.last_kv
    out: dict[str, Any] = {
        "max_concurrent_requests": int(sums.max.get("running", 0)),
        "mean_concurrent_requests": None,
        "preemptions": int(sums.sum.get("preempted", 0)),
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
    if not sums.steps:
        return out
    has = lambda name: name not in sums.missing  # noqa: E731
    out["mean_concurrent_requests"] = _ratio(sums, "running_dt", sums.dt)
    if has("kv_reserved_bytes"):
        out["peak_kv_reserved_bytes"] = int(sums.max["reserved"])
        denom = sums.sum["busy_reserved_dt"]
        if has("kv_used_bytes"):
            out["peak_kv_used_bytes"] = int(sums.max["used"])
            util = _ratio(sums, "busy_used_dt", denom)
            if util is not None:
                out["mean_kv_utilization"] = util
                out["kv_waste_pct"] = 100.0 * (1.0 - util)
                if has("kv_reserved_ahead_bytes"):
                    res_waste = 100.0 * sums.sum["busy_ahead_dt"] / denom
                    out["kv_reservation_waste_pct"] = res_waste
                    out["kv_internal_waste_pct"] = out["kv_waste_pct"] - res_waste
        if has("kv_shared_bytes"):
            out["shared_block_ratio"] = _ratio(sums, "busy_shared_dt", denom)
    if has("page_table_entries"):
        out["peak_page_table_entries"] = int(sums.max["entries"])
        out["mean_page_table_entries"] = _ratio(sums, "entries_dt", sums.dt)
        out["peak_page_table_bytes"] = int(sums.max["entries"]) * PAGE_TABLE_ENTRY_BYTES
    if has("kv_free_bytes") and has("kv_largest_free_bytes") and "frag" in sums.min:
        out["min_frag_index"] = sums.min["frag"]
        out["mean_frag_index"] = _ratio(sums, "frag_dt", sums.sum["free_dt"])
    if kv is not None:
        if kv.block_allocs is not None and kv.block_frees is not None and run.duration_s > 0:
            out["page_turnover_per_s"] = (kv.block_allocs + kv.block_frees) / run.duration_s
        if kv.prefix_query_tokens:
            out["prefix_hit_rate"] = (kv.prefix_hit_tokens or 0) / kv.prefix_query_tokens
        if run.status == "ok":
            out["kv_retained_bytes"] = kv.reserved_bytes
    return out


FRAGMENTATION_WORST = ("t_s", "free_bytes", "largest_free_bytes", "need_bytes")


def fragmentation_metrics(sums: StepSums) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kv_wait_s": None, "fragmentation_wait_steps": None, "fragmentation_wait_s": None,
        **{f"fragmentation_wait_{name}": None for name in FRAGMENTATION_WORST},
    }
    refusals = ("kv_refused_bytes", "kv_refused_free_bytes", "kv_refused_largest_free_bytes")
    if not sums.steps or any(name in sums.missing for name in refusals):
        return out
    out["kv_wait_s"] = sums.sum["wait_dt"]
    out["fragmentation_wait_steps"] = int(sums.sum["waits"])
    out["fragmentation_wait_s"] = sums.sum["waits_dt"]
    if sums.worst is not None:
        free, t_s, largest, need = sums.worst
        out.update(zip((f"fragmentation_wait_{n}" for n in FRAGMENTATION_WORST),
                       (t_s, int(free), largest, need), strict=True))
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


def memory_metrics(run: EngineRun, sums: StepSums | None = None) -> dict[str, Any]:
    out = measured_memory_metrics(run)
    if run.steps.device:
        out.update(modelled_device_metrics(run, sums or run_sums(run.steps)))
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


def modelled_device_metrics(run: EngineRun, sums: StepSums) -> dict[str, Any]:
    """Device metrics of an engine that models its device's memory (the simulator), in
    place of measured ones; empty for the others. Host RSS stays a host metric."""
    if sums.peak is None:
        return {}
    used, components = sums.peak
    out: dict[str, Any] = {
        "peak_device_bytes": int(used),
        "peak_device_bytes_per_rank": int(used) // run.steps.device_ranks,
        "peak_device_allocated_bytes": int(sums.max["device_allocated"]),
        "peak_device_reserved_bytes": int(sums.max["device_reserved"]),
        **{f"peak_device_{name}_bytes": int(value)
           for name, value in zip(DeviceMemory.COMPONENTS, components, strict=True)},
        "device_growth_pct": None,
    }
    if run.warmup_step is not None:
        out["device_growth_pct"] = _growth_pct(device_used_at(run.steps, run.warmup_step),
                                               device_used_at(run.steps, len(run.steps) - 1))
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
