"""Summary metrics of a run: pure functions over the harness's timings, step log and
telemetry samples. Names follow ``vllm bench serve`` where they overlap.

Times are in the run's clock and latencies count from the request's arrival; "busy steps"
are steps where some KV is reserved; time-weighted means weight each step by its duration.
Latencies are reported as ``mean_/median_/p90_/p99_<name>_ms``. KV metrics read the engine's
``KVStats`` after every step; process and device metrics read the telemetry samples, or, for
engines that model device memory (:mod:`kvbench.engines.sim.device_memory`), the modelled
step peaks in their place.

What each metric means: docs/metrics.md ("Metrics", "Simulated device memory"); its unit,
direction and kind: :mod:`kvbench.results.metric_table`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.engines.base import DeviceMemory
from kvbench.engines.kv.modality import MODALITIES
from kvbench.engines.kv.offload import TIER_KINDS
from kvbench.engines.sim.device_memory import DeviceOutOfMemory
from kvbench.results.gaps import weighted_stats
from kvbench.results.runlog import EngineRun
from kvbench.results.slo import SLO
from kvbench.results.stepstats import StepSums, device_used_at, run_sums

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
    from the step before, and the other gaps once each (:class:`~kvbench.results.gaps.GapLog`).
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
    summary.update(oracle_metrics(run))
    summary.update(offload_metrics(run))
    summary.update(fragmentation_metrics(sums))
    summary.update(memory_metrics(run, sums))
    summary.update(modal_metrics(run, sums))
    summary.update(modality_metrics(run, sums))
    summary.update(group_metrics(run, sums))
    return summary


def group_metrics(run: EngineRun, sums: StepSums) -> dict[str, Any]:
    """Per kind of layer group of a pool allocating KV per group (its groups together):
    peak reserved and used bytes and peak usage of the memory it draws on, waste (1 - used /
    reserved summed over the steps), and the prefix hit rate its groups alone could have
    served (the request's is the least over every group). Only kinds the run has; a served
    engine publishes usage alone."""
    kv = run.last_kv
    if kv is None or not kv.groups:
        return {}
    out: dict[str, Any] = {}
    queried = kv.prefix_query_tokens
    for kind in dict.fromkeys(g["kind"] for g in kv.groups.values()):
        peak = sums.max.get
        reserved, used = peak(f"group:{kind}_reserved_bytes"), peak(f"group:{kind}_used_bytes")
        out[f"peak_kv_{kind}_group_reserved_bytes"] = None if reserved is None else int(reserved)
        out[f"peak_kv_{kind}_group_used_bytes"] = None if used is None else int(used)
        out[f"peak_kv_{kind}_group_usage"] = peak(f"group:{kind}_usage")
        total = sums.sum.get(f"group:{kind}_reserved_bytes", 0.0)
        out[f"kv_{kind}_group_waste_pct"] = (
            100.0 * (1.0 - sums.sum[f"group:{kind}_used_bytes"] / total)
            if total > 0 and used is not None else None)
        hits = [g["hit_tokens"] for g in kv.groups.values()
                if g["kind"] == kind and "hit_tokens" in g]
        if hits and queried:
            out[f"prefix_hit_rate_{kind}_group"] = min(hits) / queried
    return out


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


def oracle_metrics(run: EngineRun) -> dict[str, float | None]:
    """The run's prefix hit rate beside the best a cache of its size could have had
    (Belady's MIN over the same block accesses) and that of a cache that never evicts; the
    same denominator, the prompt tokens looked up."""
    out: dict[str, float | None] = dict.fromkeys(
        ("oracle_hit_rate", "hit_rate_vs_oracle", "unbounded_hit_rate"))
    out.update(dict.fromkeys((*(f"oracle_hit_rate_{k}" for k in TIER_KINDS),
                              "hit_rate_vs_oracle_offload")))
    oracle, kv = run.prefix_oracle, run.last_kv
    if oracle is None or kv is None or not kv.prefix_query_tokens:
        return out
    queried = kv.prefix_query_tokens
    out["oracle_hit_rate"] = oracle.hit_tokens / queried
    out["unbounded_hit_rate"] = oracle.unbounded_hit_tokens / queried
    if oracle.hit_tokens:
        out["hit_rate_vs_oracle"] = (kv.prefix_hit_tokens or 0) / oracle.hit_tokens
    for kind, hit_tokens in oracle.tiers:
        out[f"oracle_hit_rate_{kind}"] = hit_tokens / queried
    if oracle.tiers and oracle.tiers[-1][1]:
        out["hit_rate_vs_oracle_offload"] = (kv.prefix_hit_tokens or 0) / oracle.tiers[-1][1]
    return out


# Per offload tier kind: offload_<kind>_<metric>.
TIER_METRICS = ("hit_rate", "loaded_bytes", "stored_bytes")
OFFLOAD_TOTALS = ("offload_hit_tokens", "offload_loaded_bytes", "offload_stored_bytes",
                  "offload_used_bytes")
# Preempted sequences' KV copied out and back (swap preemption): part of the bytes moved.
SWAP_TOTALS = ("offload_swapped_out_bytes", "offload_swapped_in_bytes")


def offload_metrics(run: EngineRun) -> dict[str, Any]:
    """KV below device memory over the run, from the last snapshot's counters: prompt tokens
    served from there (and their share of those looked up), bytes moved each way and the
    rate each direction achieved while it moved, the bytes held at the end, per tier too;
    for simulated tiers, the seconds steps waited on loads and the prefill seconds the
    loads spared, net of the loads."""
    kv = run.last_kv
    out: dict[str, Any] = dict.fromkeys(
        ("offload_hit_rate", *OFFLOAD_TOTALS, *SWAP_TOTALS, "offload_load_gbps",
         "offload_store_gbps",
         "offload_load_s", "offload_stall_s", "offload_prefill_saved_s",
         *(f"offload_{k}_{m}" for k in TIER_KINDS for m in TIER_METRICS)))
    if kv is None:
        return out
    for name in (*OFFLOAD_TOTALS, *SWAP_TOTALS):
        out[name] = getattr(kv, name)
    out["offload_load_s"] = kv.offload_load_s
    tiers = kv.offload_tiers or {}
    if tiers and run.offload_stall_s is not None:
        out["offload_stall_s"] = run.offload_stall_s
    saved = [t.get("saved_s") for t in tiers.values()]
    if saved and None not in saved:
        out["offload_prefill_saved_s"] = sum(saved)
    for kind, tier in tiers.items():
        for way in ("loaded", "stored"):
            out[f"offload_{kind}_{way}_bytes"] = tier.get(f"{way}_bytes")
    queried = kv.prefix_query_tokens
    if kv.offload_hit_tokens is not None and queried:
        out["offload_hit_rate"] = kv.offload_hit_tokens / queried
        for kind, tier in tiers.items():
            if tier.get("hit_tokens") is not None:
                out[f"offload_{kind}_hit_rate"] = tier["hit_tokens"] / queried
    for way, moved, took in (("load", kv.offload_loaded_bytes, kv.offload_load_s),
                             ("store", kv.offload_stored_bytes, kv.offload_store_s)):
        if moved is not None and took:
            out[f"offload_{way}_gbps"] = moved / took / 1e9
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
