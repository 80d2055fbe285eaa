"""The metric table: every summary metric and curve a run record holds, declared once.

Each entry states what the gate, the thresholds file, the run tables and the published tables
need to know about a metric:

- ``unit``: what the number counts (units are also in the names: ``_bytes``, ``_ms``, ``_s``,
  ``_pct``);
- ``direction``: which way is better (``lower`` | ``higher``), or ``none`` for numbers that
  describe the input or the run rather than how well it went -- those cannot be gated;
- ``kind``: how a comparison treats it. ``deterministic``: fixed by the workload and the
  configuration, exact on any clock. ``clock``: follows the record's clock -- under the
  virtual clock time is the cost model's, so the value is exact; under the wall clock it is
  measured. ``timing``: measured on the machine (process memory, wall time), noisy on any
  clock. ``device``: device memory, which follows the record's device -- modelled on a
  simulated one (``sim:...``), so exact; measured on a real one, so timing;
- ``label`` and ``fmt``: how tables show it (``fmt`` is a format spec, or ``bytes``,
  ``fraction`` for a 0..1 share shown as a percentage, ``bool``);
- ``report``: shown in the side-by-side run tables (``kvbench run``, ``report``, ``publish``),
  in table order;
- ``needs``: the conditions without which the metric is absent or None (a goodput SLO, a
  soak, a CUDA device, a device whose memory is measured or modelled, an out-of-memory
  failure, a fragmentation wait); empty for metrics every run of a built-in engine produces.

Definitions of the values are in :mod:`kvbench.results.metrics` (summary metrics) and
:mod:`kvbench.results.curves` (curves).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kvbench.units import format_bytes

Direction = Literal["lower", "higher", "none"]
# The components of a simulated device's memory (kvbench.engines.base.DeviceMemory).
DEVICE_COMPONENTS = (
    ("weights", "weights"), ("kv", "KV cache"), ("activation", "activations"),
    ("attention", "attention workspace"), ("encoder", "encoder outputs"),
    ("kv_cached", "allocator cache around KV"),
    ("workspace_cached", "allocator cache of the workspace"), ("non_torch", "non-torch memory"),
)
Kind = Literal["deterministic", "clock", "timing", "device"]
# What a metric needs to have a value: a goodput SLO (--slo), a soak run, a CUDA device, a
# KV policy that keeps that counter (mixed pages merge and split, virtual memory maps, ...),
# a device whose memory is measured (CUDA) or modelled (simulated), a run that ran out of
# the modelled device's memory, a request refused admission although enough KV memory was
# free in total, a cluster of replicas, disaggregated prefill/decode replicas.
# ``modal``: a modality-aware KV pool (its page classes' figures). ``quality``: a real-compute
# run of an engine storing KV below the model's dtype, checked against full precision.
# ``wall``: a wall-clock run of an engine in this process (not a served one). ``offload``: a
# served engine that publishes metrics of KV kept below device memory. ``groups``: a KV pool
# allocating per layer group, with a group of that kind.
Need = Literal["slo", "soak", "cuda", "policy", "device", "oom", "fragmentation", "cluster",
               "disaggregated", "modal", "quality", "wall", "offload", "groups"]
# The page classes of a modality-aware pool (kvbench.engines.kv.modal).
MODAL_CLASSES = ("text", "vision")
# The kinds of layer group a pool allocating KV per group holds (kvbench.engines.kv.hybrid;
# chunked groups are planned, not simulated).
GROUP_KINDS = ("full", "sliding", "latent", "state")
# The modalities of the tokens KV holds (kvbench.engines.kv.modality).
MODALITIES = ("text", "image", "audio")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    unit: str
    direction: Direction
    kind: Kind
    label: str
    fmt: str = ".4g"
    report: bool = False
    needs: tuple[Need, ...] = ()

    @property
    def gateable(self) -> bool:
        return self.direction != "none"

    def format(self, value: Any) -> str:
        """The value as tables show it; "-" for a missing one, NaN and infinities as such."""
        if value is None:
            return "-"
        if isinstance(value, bool) or self.fmt == "bool":
            return "yes" if value else "no"
        if not math.isfinite(value):
            return str(float(value))
        if self.fmt == "bytes":
            return format_bytes(value)
        if self.fmt == "fraction":
            return f"{100 * value:.1f}%"
        if self.fmt == "d":
            # A count read back from JSON may be a float; one with a fraction (a median of
            # repeats) keeps it rather than being rounded away.
            return str(int(value)) if float(value).is_integer() else f"{value:.4g}"
        return format(value, self.fmt)


# The built-in engine's offload tier kinds (kvbench.engines.kv.offload.TIER_KINDS, which
# this reader may not import; a test keeps the two equal).
OFFLOAD_TIER_KINDS = ("cpu", "cxl", "disk")


def _m(name: str, unit: str, direction: Direction, kind: Kind, label: str, fmt: str = ".4g",
       *, report: bool = False, needs: tuple[Need, ...] = ()) -> MetricSpec:
    return MetricSpec(name, unit, direction, kind, label, fmt, report, needs)


# Latency percentiles per completed request: the run tables show these.
_REPORTED_LATENCIES = {"median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                       "median_e2el_ms"}
_LATENCIES = tuple(
    _m(name, "ms", "lower", "clock", f"{short} {stat_label} (ms)", fmt,
       report=name in _REPORTED_LATENCIES)
    for what, short, fmt in (("ttft", "TTFT", ".1f"), ("tpot", "TPOT", ".2f"),
                             ("itl", "ITL", ".2f"), ("e2el", "E2EL", ".1f"))
    for stat, stat_label in (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99"))
    for name in [f"{stat}_{what}_ms"]
)

# Summary metrics by topic: requests and throughput, latency, concurrency and KV, process and
# device memory, soak. The run tables show the ``report`` ones in this order.
_MODAL_METRICS = tuple(
    spec
    for c in MODAL_CLASSES
    for spec in (
        _m(f"kv_{c}_element_bytes", "bytes", "none", "deterministic",
           f"{c} KV bytes per element", "bytes", needs=("modal",)),
        _m(f"kv_{c}_page_tokens", "tokens", "none", "deterministic", f"{c} page tokens", "d",
           needs=("modal",)),
        _m(f"peak_kv_{c}_reserved_bytes", "bytes", "lower", "clock", f"peak {c} KV reserved",
           "bytes", needs=("modal",)),
        _m(f"peak_kv_{c}_used_bytes", "bytes", "lower", "clock", f"peak {c} KV used", "bytes",
           needs=("modal",)),
        _m(f"mean_kv_{c}_utilization", "fraction", "none", "clock",
           f"{c} pool utilization (reserved/capacity)", "fraction", needs=("modal",)),
        _m(f"kv_{c}_waste_pct", "%", "lower", "clock", f"{c} KV waste %", ".1f",
           needs=("modal",)),
    )
)
# KV bytes by the modality of the tokens held: every built-in engine's run has them, None
# where its used KV could not be attributed to modalities (shared between sequences).
_MODALITY_METRICS = tuple(
    spec
    for m in MODALITIES
    for spec in (
        _m(f"kv_{m}_dtype_bytes", "bytes", "none", "deterministic",
           f"{m} KV dtype bytes per element", "bytes"),
        _m(f"peak_kv_{m}_bytes", "bytes", "lower", "clock", f"peak {m} KV", "bytes",
           report=True),
    )
)
_MODALITY_CURVES = tuple(
    _m(f"kv_{m}_bytes", "bytes", "lower", "clock", f"{m} KV", "bytes") for m in MODALITIES
)
_MODAL_CURVES = tuple(
    _m(f"kv_{c}_{what}_bytes", "bytes", "none" if what == "capacity" else "lower", "clock",
       f"{c} KV {what}", "bytes", needs=("modal",))
    for c in MODAL_CLASSES for what in ("reserved", "used", "capacity")
)
# Per kind of layer group of a pool that allocates KV per group, its groups together.
_GROUP_METRICS = tuple(
    spec
    for k in GROUP_KINDS
    for spec in (
        _m(f"peak_kv_{k}_group_reserved_bytes", "bytes", "lower", "clock",
           f"peak {k}-group KV reserved", "bytes", needs=("groups",)),
        _m(f"peak_kv_{k}_group_used_bytes", "bytes", "lower", "clock",
           f"peak {k}-group KV used", "bytes", needs=("groups",)),
        _m(f"peak_kv_{k}_group_usage", "fraction", "lower", "clock",
           f"peak {k}-group usage of its pool", "fraction", needs=("groups",)),
        _m(f"kv_{k}_group_waste_pct", "%", "lower", "clock", f"{k}-group KV waste %", ".1f",
           needs=("groups",)),
        _m(f"prefix_hit_rate_{k}_group", "fraction", "higher", "clock",
           f"prefix hit rate the {k} group alone could serve", "fraction",
           needs=("groups",)),
    )
)
_GROUP_CURVES = tuple(
    spec
    for k in GROUP_KINDS
    for spec in (
        *(_m(f"kv_{k}_group_{what}_bytes", "bytes", "lower", "clock", f"{k}-group KV {what}",
             "bytes", needs=("groups",)) for what in ("reserved", "used")),
        _m(f"kv_{k}_group_usage", "fraction", "lower", "clock", f"{k}-group usage of its pool",
           "fraction", needs=("groups",)),
    )
)
_OFFLOAD_CURVES = tuple(
    _m(f"offload_{k}_used_bytes", "bytes", "none", "clock", f"KV held in the {k} tier",
       "bytes", needs=("offload",)) for k in OFFLOAD_TIER_KINDS
)

METRICS: tuple[MetricSpec, ...] = (
    _m("num_requests", "requests", "none", "deterministic", "requests", "d"),
    _m("completed", "requests", "higher", "clock", "completed requests", "d", report=True),
    _m("rejected", "requests", "lower", "deterministic", "rejected requests", "d", report=True),
    # Requests a served engine could not complete (HTTP errors, timeouts, lost connections).
    _m("failed", "requests", "lower", "clock", "failed requests", "d"),
    _m("duration_s", "s", "lower", "clock", "duration (s)", ".2f", report=True),
    _m("wall_time_s", "s", "lower", "timing", "wall time (s)", ".2f"),
    _m("num_steps", "steps", "none", "clock", "engine steps", "d"),
    _m("request_throughput", "requests/s", "higher", "clock", "requests/s", ".2f", report=True),
    _m("output_throughput", "tokens/s", "higher", "clock", "output tokens/s", ".1f",
       report=True),
    _m("total_token_throughput", "tokens/s", "higher", "clock", "total tokens/s", ".1f",
       report=True),
    _m("total_output_tokens", "tokens", "none", "clock", "output tokens", "d"),
    _m("output_throughput_per_cpu_s", "tokens/CPU-s", "higher", "timing",
       "output tokens per CPU-second", ".1f", report=True, needs=("wall",)),
    _m("request_goodput", "requests/s", "higher", "clock", "goodput (requests/s)", ".2f",
       needs=("slo",)),
    _m("slo_attainment_pct", "%", "higher", "clock", "SLO attainment %", ".1f",
       needs=("slo",)),
    *_LATENCIES,
    _m("max_concurrent_requests", "requests", "higher", "clock", "max concurrent requests", "d",
       report=True),
    _m("mean_concurrent_requests", "requests", "higher", "clock", "mean concurrent requests",
       ".1f", report=True),
    _m("kv_capacity_bytes", "bytes", "none", "deterministic", "KV capacity", "bytes",
       report=True),
    _m("peak_kv_reserved_bytes", "bytes", "lower", "clock", "peak KV reserved", "bytes",
       report=True),
    _m("peak_kv_used_bytes", "bytes", "lower", "clock", "peak KV used", "bytes", report=True),
    _m("mean_kv_utilization", "fraction", "higher", "clock", "KV utilization (used/reserved)",
       "fraction", report=True),
    _m("kv_waste_pct", "%", "lower", "clock", "KV waste %", ".1f", report=True),
    _m("kv_reservation_waste_pct", "%", "lower", "clock", "KV reserved ahead %", ".1f"),
    _m("kv_internal_waste_pct", "%", "lower", "clock", "KV internal waste %", ".1f"),
    _m("min_frag_index", "ratio", "higher", "clock", "min fragmentation index", ".3f",
       report=True),
    _m("mean_frag_index", "ratio", "higher", "clock", "mean fragmentation index", ".3f"),
    _m("kv_wait_s", "s", "lower", "clock", "time a request waited for KV (s)", ".2f",
       report=True),
    _m("fragmentation_wait_s", "s", "lower", "clock", "of which with enough KV free (s)", ".2f",
       report=True),
    _m("peak_encoder_cache_bytes", "bytes", "lower", "clock", "peak encoder cache", "bytes"),
    _m("mean_encoder_cache_bytes", "bytes", "lower", "clock", "mean encoder cache", "bytes"),
    *_MODAL_METRICS,
    *_GROUP_METRICS,
    *_MODALITY_METRICS,
    # Output agreement with the full-precision reference pass (kvbench.run.quality).
    _m("mean_output_match_rate", "fraction", "higher", "clock",
       "output match rate vs full precision", "fraction", report=True, needs=("quality",)),
    _m("identical_output_fraction", "fraction", "higher", "clock",
       "requests identical to full precision", "fraction", needs=("quality",)),
    _m("min_first_divergence", "tokens", "none", "clock", "earliest first divergence (token)",
       "d", needs=("quality",)),
    _m("probe_max_abs_logit_diff", "logits", "lower", "clock", "probe max abs logit diff",
       ".3g", report=True, needs=("quality",)),
    _m("probe_mean_abs_logit_diff", "logits", "lower", "clock", "probe mean abs logit diff",
       ".3g", needs=("quality",)),
    _m("fragmentation_wait_steps", "steps", "lower", "clock", "steps waiting with enough KV free",
       "d"),
    # The worst of those refusals (the most memory free): facts of one moment.
    *(
        _m(f"fragmentation_wait_{name}", unit, "none", "clock",
           f"{what} the worst fragmentation wait{unit_label}", fmt, needs=("fragmentation",))
        for name, unit, what, unit_label, fmt in (
            ("t_s", "s", "time of", " (s)", ".2f"),
            ("free_bytes", "bytes", "KV free at", "", "bytes"),
            ("largest_free_bytes", "bytes", "largest hole at", "", "bytes"),
            ("need_bytes", "bytes", "request refused at", "", "bytes"),
        )
    ),
    _m("preemptions", "preemptions", "lower", "clock", "preemptions", "d", report=True),
    # Allocator churn and prefix sharing follow the workload; neither way is better.
    _m("page_turnover_per_s", "1/s", "none", "clock", "page allocs + frees per s", ".1f"),
    _m("prefix_hit_rate", "fraction", "higher", "clock", "prefix cache hit rate", "fraction",
       report=True),
    # The best any cache of the same size could do on the run's accesses (engines.kv.oracle).
    _m("oracle_hit_rate", "fraction", "none", "clock", "optimal (MIN) prefix hit rate",
       "fraction", needs=("policy",)),
    _m("hit_rate_vs_oracle", "fraction", "higher", "clock", "prefix hit rate / optimal",
       "fraction", needs=("policy",)),
    _m("unbounded_hit_rate", "fraction", "none", "clock", "prefix hit rate, unbounded cache",
       "fraction", needs=("policy",)),
    # KV below device memory (a served engine's offloading connector, LMCache or HiCache).
    _m("offload_hit_rate", "fraction", "higher", "clock",
       "prompt tokens served from below device memory", "fraction", needs=("offload",)),
    _m("offload_hit_tokens", "tokens", "none", "clock", "tokens hit below device memory",
       "d", needs=("offload",)),
    _m("offload_loaded_bytes", "bytes", "none", "clock", "KV loaded from below device memory",
       "bytes", needs=("offload",)),
    _m("offload_stored_bytes", "bytes", "none", "clock", "KV stored below device memory",
       "bytes", needs=("offload",)),
    _m("offload_used_bytes", "bytes", "none", "clock", "KV held below device memory at the end",
       "bytes", needs=("offload",)),
    _m("offload_swapped_out_bytes", "bytes", "none", "clock",
       "KV of preempted sequences swapped out", "bytes", needs=("offload",)),
    _m("offload_swapped_in_bytes", "bytes", "none", "clock",
       "KV of preempted sequences swapped back in", "bytes", needs=("offload",)),
    _m("offload_load_gbps", "GB/s", "higher", "timing", "offload load rate (GB/s)", ".2f",
       needs=("offload",)),
    _m("offload_store_gbps", "GB/s", "higher", "timing", "offload store rate (GB/s)", ".2f",
       needs=("offload",)),
    _m("offload_load_s", "s", "lower", "clock", "time moving KV up from offload tiers", ".4g",
       needs=("offload",)),
    _m("offload_stall_s", "s", "lower", "clock", "time steps waited on offload loads",
       ".4g", needs=("offload",)),
    _m("offload_prefill_saved_s", "s", "higher", "clock",
       "prefill time loads spared, net of loading", ".4g", needs=("offload",)),
    # Per tier of the built-in engine's offload, and MIN with that tier and those above it.
    *(_m(f"offload_{kind}_hit_rate", "fraction", "higher", "clock",
         f"prompt tokens served from the {kind} tier", "fraction", needs=("offload",))
      for kind in OFFLOAD_TIER_KINDS),
    *(_m(f"offload_{kind}_{way}_bytes", "bytes", "none", "clock",
         f"KV {way} {'from' if way == 'loaded' else 'to'} the {kind} tier", "bytes",
         needs=("offload",))
      for kind in OFFLOAD_TIER_KINDS for way in ("loaded", "stored")),
    *(_m(f"oracle_hit_rate_{kind}", "fraction", "none", "clock",
         f"optimal (MIN) hit rate, device + tiers to {kind}", "fraction", needs=("offload",))
      for kind in OFFLOAD_TIER_KINDS),
    _m("hit_rate_vs_oracle_offload", "fraction", "higher", "clock",
       "prefix hit rate / optimal with every tier", "fraction", needs=("offload",)),
    _m("shared_block_ratio", "fraction", "none", "clock", "KV shared by several sequences",
       "fraction"),
    _m("kv_retained_bytes", "bytes", "lower", "clock", "KV retained after the run", "bytes"),
    _m("peak_page_table_entries", "entries", "lower", "clock", "peak page-table entries", "d"),
    _m("mean_page_table_entries", "entries", "lower", "clock", "mean page-table entries",
       ".1f"),
    _m("peak_page_table_bytes", "bytes", "lower", "clock", "peak page-table size", "bytes"),
    _m("kv_copied_bytes", "bytes", "lower", "clock", "KV copied between slots", "bytes"),
    _m("kv_evictions", "blocks", "lower", "clock", "prefix-cache evictions", "d",
       needs=("policy",)),
    _m("kv_merges", "merges", "none", "clock", "page merges", "d", needs=("policy",)),
    _m("kv_splits", "splits", "none", "clock", "page splits", "d", needs=("policy",)),
    _m("kv_migrated_bytes", "bytes", "lower", "clock", "KV migrated to merge pages", "bytes",
       needs=("policy",)),
    _m("kv_map_ops", "operations", "lower", "clock", "page map operations", "d",
       needs=("policy",)),
    _m("kv_unmap_ops", "operations", "lower", "clock", "page unmap operations", "d",
       needs=("policy",)),
    _m("peak_rss_bytes", "bytes", "lower", "timing", "peak process RSS", "bytes", report=True),
    _m("peak_device_bytes", "bytes", "lower", "device", "peak device memory", "bytes",
       report=True, needs=("device",)),
    _m("peak_cuda_allocated_bytes", "bytes", "lower", "timing", "peak torch allocated",
       "bytes", needs=("cuda",)),
    _m("peak_cuda_reserved_bytes", "bytes", "lower", "timing", "peak torch reserved", "bytes",
       needs=("cuda",)),
    _m("peak_cuda_inactive_split_bytes", "bytes", "lower", "timing",
       "peak allocator fragmentation (inactive split)", "bytes", needs=("cuda",)),
    _m("cuda_alloc_retries", "retries", "lower", "timing", "CUDA allocation retries", "d",
       needs=("cuda",)),
    _m("rss_growth_pct", "%", "lower", "timing", "RSS growth after warm-up %", ".1f"),
    _m("device_growth_pct", "%", "lower", "device", "device memory growth after warm-up %",
       ".1f", needs=("device",)),
    _m("memory_growth_pct", "%", "lower", "device", "memory growth after warm-up %", ".1f"),
    # A simulated device's memory (kvbench.engines.sim.device_memory): step peaks, and the
    # components at the step of peak_device_bytes.
    _m("peak_device_bytes_per_rank", "bytes", "lower", "device",
       "peak device memory per rank (modelled)", "bytes", needs=("device",)),
    _m("peak_device_allocated_bytes", "bytes", "lower", "device",
       "peak device allocated (modelled)", "bytes", needs=("device",)),
    _m("peak_device_reserved_bytes", "bytes", "lower", "device",
       "peak device reserved (modelled)", "bytes", needs=("device",)),
    *(
        _m(f"peak_device_{name}_bytes", "bytes", "lower", "device",
           f"{what} at the device peak", "bytes", needs=("device",))
        for name, what in DEVICE_COMPONENTS
    ),
    # What the step (or start-up) that ran out of device memory needed, per rank.
    _m("device_oom_needed_bytes", "bytes", "none", "device", "out of memory: needed per rank",
       "bytes", needs=("oom",)),
    _m("device_oom_free_bytes", "bytes", "none", "device", "out of memory: free per rank",
       "bytes", needs=("oom",)),
    _m("device_oom_memory_bytes", "bytes", "none", "device", "out of memory: rank memory",
       "bytes", needs=("oom",)),
    *(
        _m(f"device_oom_{name}_bytes", "bytes", "none", "device",
           f"out of memory: {what} needed per rank", "bytes", needs=("oom",))
        for name, what in DEVICE_COMPONENTS
    ),
    # A cluster of replicas behind a router (kvbench.results.cluster).
    _m("replicas", "engines", "none", "deterministic", "replicas", "d", needs=("cluster",)),
    _m("load_imbalance", "ratio", "lower", "clock", "load imbalance (max/mean running)",
       ".3f", needs=("cluster",)),
    _m("peak_replica_concurrent_requests", "requests", "none", "clock",
       "busiest replica's max concurrent", "d", needs=("cluster",)),
    _m("min_replica_max_concurrent_requests", "requests", "none", "clock",
       "least busy replica's max concurrent", "d", needs=("cluster",)),
    _m("cluster_prefix_hit_rate", "ratio", "higher", "clock", "cluster prefix hit rate",
       "fraction", needs=("cluster",)),
    _m("requests_moved_by_load_cap", "requests", "none", "clock",
       "requests moved by the load cap", "d", needs=("cluster",)),
    _m("kv_transfers", "requests", "none", "clock", "KV transfers", "d",
       needs=("disaggregated",)),
    _m("kv_transfer_bytes", "bytes", "lower", "clock", "KV transferred", "bytes",
       needs=("disaggregated",)),
    _m("mean_kv_transfer_ms", "ms", "lower", "clock", "KV transfer mean (ms)", ".2f",
       needs=("disaggregated",)),
    _m("mean_kv_link_wait_ms", "ms", "lower", "clock", "KV link wait mean (ms)", ".2f",
       needs=("disaggregated",)),
    _m("mean_decode_admission_wait_ms", "ms", "lower", "clock",
       "decode admission wait mean (ms)", ".2f", needs=("disaggregated",)),
    _m("kv_transfer_share_of_ttft_pct", "%", "lower", "clock", "KV transfer share of TTFT %",
       ".1f", needs=("disaggregated",)),
    _m("peak_prefill_kv_reserved_bytes", "bytes", "none", "clock",
       "peak KV reserved, prefill replicas", "bytes", needs=("disaggregated",)),
    _m("peak_decode_kv_reserved_bytes", "bytes", "none", "clock",
       "peak KV reserved, decode replicas", "bytes", needs=("disaggregated",)),
    _m("peak_kv_held_for_transfer_bytes", "bytes", "none", "clock",
       "peak KV held for transfers", "bytes", needs=("disaggregated",)),
    _m("telemetry_overhead_pct", "%", "lower", "timing", "telemetry overhead %", ".2f"),
    _m("soak_waves", "waves", "none", "deterministic", "soak waves completed", "d",
       needs=("soak",)),
    _m("soak_memory_growth_pct", "%", "lower", "timing", "soak memory growth %", ".1f",
       needs=("soak",)),
    _m("leak_detected", "", "none", "timing", "leak detected", "bool", needs=("soak",)),
    # Growth per soak wave of what stayed after each drain (kvbench.results.leaks kinds).
    _m("leak_kv_reserved_bytes_per_wave", "bytes/wave", "lower", "clock",
       "KV retained growth per wave", "bytes", needs=("soak",)),
    _m("leak_rss_bytes_per_wave", "bytes/wave", "lower", "timing", "RSS growth per wave",
       "bytes", needs=("soak",)),
    *(
        _m(f"leak_{kind}_bytes_per_wave", "bytes/wave", "lower", "timing",
           f"{what} growth per wave", "bytes", needs=("soak", "cuda"))
        for kind, what in (("cuda_allocated", "torch allocated"),
                           ("cuda_reserved", "torch reserved"),
                           ("nvml_device_used", "device used (NVML)"),
                           ("nvml_process_used", "process device memory (NVML)"))
    ),
)

# Curves (per-step columns downsampled over the run, all on the time axis ``t_s``).
CURVE_TIME = "t_s"
CURVES: tuple[MetricSpec, ...] = (
    _m(CURVE_TIME, "s", "none", "clock", "run time"),
    _m("kv_capacity_bytes", "bytes", "none", "deterministic", "KV capacity", "bytes"),
    _m("kv_reserved_bytes", "bytes", "lower", "clock", "KV reserved", "bytes"),
    _m("kv_used_bytes", "bytes", "lower", "clock", "KV used", "bytes"),
    _m("kv_reserved_ahead_bytes", "bytes", "lower", "clock", "KV reserved ahead", "bytes"),
    _m("kv_shared_bytes", "bytes", "none", "clock", "KV shared", "bytes"),
    _m("kv_free_bytes", "bytes", "none", "clock", "KV free", "bytes"),
    _m("kv_largest_free_bytes", "bytes", "higher", "clock", "largest free KV extent", "bytes"),
    _m("frag_index", "ratio", "higher", "clock", "fragmentation index", ".3f"),
    # A request's footprint where it was refused although enough memory was free, else 0.
    _m("fragmentation_wait_bytes", "bytes", "lower", "clock",
       "request refused with enough KV free", "bytes"),
    _m("running", "requests", "higher", "clock", "requests running", "d"),
    _m("waiting", "requests", "lower", "clock", "requests waiting", "d"),
    _m("preempted", "preemptions", "lower", "clock", "preemptions", "d"),
    # Cumulative counters: their slope follows the workload.
    _m("num_tokens", "tokens", "none", "clock", "tokens in the KV cache", "d"),
    _m("prefix_hit_tokens", "tokens", "none", "clock", "prefix cache hit tokens", "d"),
    _m("block_allocs", "allocations", "none", "clock", "page allocations", "d"),
    _m("block_frees", "frees", "none", "clock", "page frees", "d"),
    _m("kv_copied_bytes", "bytes", "none", "clock", "KV copied between slots", "bytes"),
    _m("page_table_entries", "entries", "lower", "clock", "page-table entries", "d"),
    _m("kv_encoder_cache_bytes", "bytes", "lower", "clock", "encoder cache", "bytes"),
    *_MODAL_CURVES,
    *_MODALITY_CURVES,
    *_OFFLOAD_CURVES,
    *_GROUP_CURVES,
    _m("rss_bytes", "bytes", "lower", "timing", "process RSS", "bytes"),
    # Disaggregated prefill/decode: KV reserved summed over each role's replicas.
    _m("prefill_kv_reserved_bytes", "bytes", "none", "clock", "KV reserved, prefill replicas",
       "bytes", needs=("disaggregated",)),
    _m("decode_kv_reserved_bytes", "bytes", "none", "clock", "KV reserved, decode replicas",
       "bytes", needs=("disaggregated",)),
    *(
        _m(f"device_{name}_bytes", "bytes", "lower", "device", f"device {what}", "bytes",
           needs=("device",))
        for name, what in (*DEVICE_COMPONENTS, ("allocated", "allocated (modelled)"),
                           ("reserved", "reserved (modelled)"), ("used", "used (modelled)"))
    ),
    *(
        _m(name, unit, "lower", "timing", label, fmt, needs=("cuda",))
        for name, unit, label, fmt in (
            ("cuda_allocated_bytes", "bytes", "torch allocated", "bytes"),
            ("cuda_reserved_bytes", "bytes", "torch reserved", "bytes"),
            ("cuda_inactive_split_bytes", "bytes", "allocator inactive split", "bytes"),
            ("cuda_alloc_retries", "retries", "CUDA allocation retries", "d"),
            ("cuda_peak_allocated_bytes", "bytes", "torch peak allocated", "bytes"),
            ("cuda_peak_reserved_bytes", "bytes", "torch peak reserved", "bytes"),
            ("nvml_device_used_bytes", "bytes", "device used (NVML)", "bytes"),
            ("nvml_process_used_bytes", "bytes", "process device memory (NVML)", "bytes"),
        )
    ),
)

METRIC_BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}
CURVE_BY_NAME: dict[str, MetricSpec] = {c.name: c for c in CURVES}
# A cluster records these curves once per replica, as ``replica<i>_<name>``.
REPLICA_CURVES = ("running", "waiting", "kv_reserved_bytes")


def curve_spec(name: str) -> MetricSpec | None:
    """The declared curve ``name`` is (``replica<i>_<curve>``: that curve's entry)."""
    head, _, rest = name.partition("_")
    if head.startswith("replica") and head[7:].isdigit() and rest in REPLICA_CURVES:
        return CURVE_BY_NAME[rest]
    return CURVE_BY_NAME.get(name)
# Gate rows name curves with this prefix ("curve:kv_reserved_bytes").
CURVE_ROW_PREFIX = "curve:"


def report_metrics() -> list[MetricSpec]:
    """The rows of the side-by-side run tables, in order."""
    return [m for m in METRICS if m.report]


def spec_for_row(row_name: str) -> MetricSpec | None:
    """The metric or curve a gate row (``name`` or ``curve:name``) is about, if known."""
    if row_name.startswith(CURVE_ROW_PREFIX):
        return curve_spec(row_name.removeprefix(CURVE_ROW_PREFIX))
    return METRIC_BY_NAME.get(row_name)


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate a misspelt ``name`` most likely meant, if any is close."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None
