"""A served engine's Prometheus ``/metrics``, parsed into one :class:`ServerSample` per scrape
and turned into the KVStats and queue sizes every engine reports.

vLLM (v1) publishes ``vllm:kv_cache_usage_perc`` (a fraction of its usable blocks, 0..1),
``vllm:num_requests_running`` / ``_waiting``, counters of preemptions, prefix-cache and
multimodal-cache queries and hits, and ``vllm:cache_config_info`` whose labels carry
``num_gpu_blocks`` and ``block_size``. SGLang publishes ``sglang:token_usage`` (a fraction),
``sglang:num_used_tokens``, ``sglang:max_total_num_tokens``, ``sglang:num_running_reqs``,
``sglang:num_queue_reqs`` and a ``sglang:cache_hit_rate`` gauge, and for a hybrid model the
usage of each pool (``sglang:full_token_usage``, ``swa_token_usage``, ``mamba_usage``), read as
layer groups. A metric a server does not publish stays None (never 0). Series of several
engines (data parallelism) are summed; usage fractions averaged.

KV kept below device memory is read where a server publishes it: vLLM's offloading
connector (``vllm:kv_offload_load_bytes`` / ``_store_bytes`` / ``_load_time`` /
``_store_time`` counters, and the connector's ``vllm:external_prefix_cache_hits``),
LMCache inside vLLM (``lmcache:num_hit_tokens``, and the bytes its local CPU and disk
backends hold, ``lmcache:local_cache_usage`` / ``local_storage_usage``), and SGLang's
HiCache (``sglang:load_back_bytes`` and ``hicache_backup_bytes`` with their duration
histograms, ``sglang:hicache_host_used_tokens``, and ``sglang:cached_tokens_total`` by
``cache_source``, of which ``host`` and ``storage`` lie below device memory). The
connector's own hit count is preferred to LMCache's, which counts the same tokens.

Only the lines of these families are handed to the parser: a vLLM page holds thousands of
histogram lines, and parsing them all would cost the client milliseconds while it stamps
streamed tokens. The page is untrusted input: its size and series are capped
(:class:`MetricsError` beyond), and a non-finite or absurd value is dropped (absent, named
in ``ServerSample.dropped``) rather than turned into KV bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, Literal

from kvbench.engines.base import KVStats

Flavor = Literal["vllm", "sglang", "unknown"]

# Sample name -> ServerSample field, per server. Counters are read from their ``_total``
# sample; ``_info`` gauges carry their facts in labels.
_VLLM = {
    "vllm:kv_cache_usage_perc": "usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:mm_cache_queries_total": "mm_cache_queries",
    "vllm:mm_cache_hits_total": "mm_cache_hits",
}
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_OFFLOAD = {
    "vllm:external_prefix_cache_hits_total": "offload_hits",
    "vllm:kv_offload_load_bytes_total": "offload_loaded_bytes",
    "vllm:kv_offload_store_bytes_total": "offload_stored_bytes",
    "vllm:kv_offload_load_time_total": "offload_load_s",
    "vllm:kv_offload_store_time_total": "offload_store_s",
    "lmcache:num_hit_tokens_total": "lmcache_hits",
    "lmcache:local_cache_usage": "lmcache_cpu_bytes",
    "lmcache:local_storage_usage": "lmcache_disk_bytes",
    "sglang:load_back_bytes_total": "offload_loaded_bytes",
    "sglang:hicache_backup_bytes_total": "offload_stored_bytes",
    "sglang:load_back_duration_seconds_sum": "offload_load_s",
    "sglang:hicache_backup_duration_seconds_sum": "offload_store_s",
    "sglang:hicache_host_used_tokens": "offload_used_tokens",
}
# Cached prompt tokens by label ``cache_source``; these sources are below device memory.
_SGLANG_CACHED = "sglang:cached_tokens_total"
_BELOW_DEVICE = frozenset({"host", "storage"})
_SGLANG = {
    "sglang:token_usage": "usage",
    "sglang:num_used_tokens": "used_tokens",
    "sglang:max_total_num_tokens": "capacity_tokens",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:cache_hit_rate": "cache_hit_rate",
    # Per pool of a hybrid model (fractions, used less free and evictable): full attention,
    # sliding-window attention, recurrent (Mamba) state.
    "sglang:full_token_usage": "full_usage",
    "sglang:swa_token_usage": "swa_usage",
    "sglang:mamba_usage": "mamba_usage",
}
# Those pools as kinds of layer group (KVStats.groups).
_POOL_KINDS = {"full_usage": "full", "swa_usage": "sliding", "mamba_usage": "state"}
_PREFIXES = (*_VLLM, _VLLM_CACHE_INFO, *_SGLANG, *_OFFLOAD, _SGLANG_CACHED)

# A /metrics page is read up to this size, and at most this many series of the families
# above are parsed: a data-parallel vLLM page holds a few hundred.
MAX_PAGE_BYTES = 8 << 20
MAX_SERIES = 10_000
# Values beyond these are no server's: fractions lie in [0, 1]; request gauges, token counts
# and counters within exact float range.
_FRACTIONS = frozenset({"usage", "cache_hit_rate", *_POOL_KINDS})
_MAX_VALUE = float(1 << 53)
# Integer labels: blocks, tokens per block, KV bytes.
_MAX_LABEL = {"num_gpu_blocks": 1 << 40, "block_size": 1 << 20,
              "kv_cache_memory_bytes": 1 << 60}
_DIGITS = re.compile(r"[0-9]{1,19}")
# A KV pool larger than this (1 PiB) is a misreading, not a server.
MAX_KV_BYTES = 1 << 50


class MetricsError(ValueError):
    """A /metrics page that cannot be read (too large, too many series, not the format)."""


@dataclass(slots=True)
class ServerSample:
    """One scrape. ``usage`` is the server's KV usage fraction; ``capacity_blocks`` and
    ``block_size`` (vLLM) or ``capacity_tokens`` (SGLang) size its pool; counters are the
    server's cumulative totals."""

    flavor: Flavor
    usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    mm_cache_queries: float | None = None
    mm_cache_hits: float | None = None
    used_tokens: float | None = None
    capacity_tokens: float | None = None
    capacity_blocks: int | None = None
    block_size: int | None = None
    # vLLM's configured KV budget, where it (not a block-count override) sized the pool.
    kv_cache_memory_bytes: int | None = None
    cache_hit_rate: float | None = None
    # SGLang's pools of a hybrid model (see _SGLANG).
    full_usage: float | None = None
    swa_usage: float | None = None
    mamba_usage: float | None = None
    # Below device memory (see the module's docstring); counters but the last three.
    offload_hits: float | None = None
    offload_loaded_bytes: float | None = None
    offload_stored_bytes: float | None = None
    offload_load_s: float | None = None
    offload_store_s: float | None = None
    lmcache_hits: float | None = None
    lmcache_cpu_bytes: float | None = None
    lmcache_disk_bytes: float | None = None
    offload_used_tokens: float | None = None
    # Fields whose published values were non-finite or absurd, and so are absent here.
    dropped: tuple[str, ...] = ()

    def present(self) -> list[str]:
        """The fields this server published (for the record)."""
        return [f.name for f in fields(self) if f.name not in ("flavor", "dropped")
                and getattr(self, f.name) is not None]


def relevant_lines(text: str) -> str:
    """The lines of ``text`` (HELP, TYPE and samples) that belong to the families read here;
    :class:`MetricsError` when they hold more than ``MAX_SERIES`` series."""
    keep = []
    series = 0
    for line in text.splitlines():
        comment = line.startswith(("# HELP ", "# TYPE "))
        if (line[7:] if comment else line).startswith(_PREFIXES):
            keep.append(line)
            series += not comment
            if series > MAX_SERIES:
                raise MetricsError(f"the page holds more than {MAX_SERIES} series of the "
                                   "vLLM and SGLang KV metrics")
    return "\n".join(keep) + "\n"


def parse_metrics(text: str) -> ServerSample:
    """A sample from a ``/metrics`` page (Prometheus text format); :class:`MetricsError`
    when the page cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    if len(text) > MAX_PAGE_BYTES:
        raise MetricsError(f"the page is over {MAX_PAGE_BYTES} bytes")
    try:
        samples = [s for family in text_string_to_metric_families(relevant_lines(text))
                   for s in family.samples]
    except MetricsError:
        raise
    except Exception as exc:  # the parser raises what it meets; any of it means unreadable
        raise MetricsError(f"not Prometheus text ({type(exc).__name__}: {exc})"[:300]) from None
    sample = ServerSample("unknown")
    sums: dict[str, float] = {}
    dropped: set[str] = set()
    # Series of each usage fraction: the engines of one server hold equal pools, so their
    # mean usage is the server's.
    series: dict[str, int] = {}
    for s in samples:
        if not s.name.startswith("lmcache:"):  # LMCache runs inside vLLM
            sample.flavor = "vllm" if s.name.startswith("vllm:") else "sglang"
        if s.name == _VLLM_CACHE_INFO:
            _cache_info(sample, s.labels, dropped)
            continue
        field = _VLLM.get(s.name) or _SGLANG.get(s.name) or _OFFLOAD.get(s.name)
        if s.name == _SGLANG_CACHED:
            field = "offload_hits" if s.labels.get("cache_source") in _BELOW_DEVICE else None
        if field is None:
            continue
        if not _plausible(field, s.value):
            dropped.add(field)
            continue
        sums[field] = sums.get(field, 0.0) + s.value
        series[field] = series.get(field, 0) + 1
    for field, value in sums.items():
        if field not in dropped:  # one engine's bad series spoils the server's sum
            mean = field == "usage" or field in _POOL_KINDS
            setattr(sample, field, value / series[field] if mean else value)
    sample.dropped = tuple(sorted(dropped))
    return sample


def _plausible(field: str, value: float) -> bool:
    upper = 1.0 if field in _FRACTIONS else _MAX_VALUE
    return math.isfinite(value) and 0.0 <= value <= upper


def _cache_info(sample: ServerSample, labels: dict[str, str], dropped: set[str]) -> None:
    """vLLM's pool size from ``cache_config_info``'s labels, summed over its engines."""
    blocks = _label_int(labels, "num_gpu_blocks", dropped, "capacity_blocks")
    size = _label_int(labels, "block_size", dropped, "block_size")
    if blocks is not None and size:
        sample.capacity_blocks = (sample.capacity_blocks or 0) + blocks
        sample.block_size = size
    budget = _label_int(labels, "kv_cache_memory_bytes", dropped, "kv_cache_memory_bytes")
    # The budget sized the pool unless a block count overrode it.
    override = labels.get("num_gpu_blocks_override")
    if budget is not None and not (override and _DIGITS.fullmatch(override)):
        sample.kv_cache_memory_bytes = (sample.kv_cache_memory_bytes or 0) + budget


def _label_int(labels: dict[str, str], name: str, dropped: set[str], field: str) -> int | None:
    """An integer label; None when absent or not a number (vLLM writes ``None``), and noted
    as dropped when it is digits beyond any real pool."""
    text = labels.get(name)
    if text is None or not text.isascii() or not text.isdigit():
        return None
    if not _DIGITS.fullmatch(text) or int(text) > _MAX_LABEL[name]:
        dropped.add(field)
        return None
    return int(text)


@dataclass(frozen=True, slots=True)
class ServerKV:
    """How a server's samples become KVStats: its pool size in bytes (None when the server
    does not publish it) and the bytes one token's KV takes (from the run's model preset,
    which must describe the served model)."""

    bytes_per_token: int
    capacity_bytes: int | None
    block_bytes: int | None  # vLLM: one block; SGLang: None (its pool is token-granular)
    usable_bytes: int | None  # what requests can hold: vLLM keeps one null block back

    @classmethod
    def of(cls, sample: ServerSample, bytes_per_token: int) -> ServerKV:
        """Capacity unknown (None) where the server does not publish it, or publishes a pool
        beyond ``MAX_KV_BYTES``."""
        if sample.capacity_blocks is not None and sample.block_size is not None:
            block = sample.block_size * bytes_per_token
            capacity = sample.capacity_blocks * block
            if capacity <= MAX_KV_BYTES:
                return cls(bytes_per_token, capacity, block, capacity - block)
        elif sample.capacity_tokens is not None:
            capacity = int(sample.capacity_tokens) * bytes_per_token
            if capacity <= MAX_KV_BYTES:
                return cls(bytes_per_token, capacity, None, capacity)
        return cls(bytes_per_token, None, None, None)

    def stats(self, sample: ServerSample, base: ServerSample) -> KVStats | None:
        """KVStats of ``sample``; prefix counters count from ``base`` (the run's start).
        Used bytes stay None: no server says how many of its reserved slots hold KV."""
        reserved = self._reserved(sample)
        if reserved is None and self.capacity_bytes is None:
            return None
        free = None
        if reserved is not None and self.usable_bytes is not None:
            free = max(0, self.usable_bytes - reserved)
        hits = _delta(sample.prefix_hits, base.prefix_hits)
        queries = _delta(sample.prefix_queries, base.prefix_queries)
        return KVStats(
            **self._offload(sample, base),
            capacity_bytes=self.capacity_bytes,
            reserved_bytes=reserved,
            free_bytes=free,
            # Any free page of a paged pool serves any request.
            largest_free_bytes=free,
            prefix_hit_tokens=None if hits is None else int(hits),
            prefix_query_tokens=None if queries is None else int(queries),
            groups={kind: {"kind": kind, "usage": getattr(sample, field)}
                    for field, kind in _POOL_KINDS.items()
                    if getattr(sample, field) is not None} or None,
        )

    def _offload(self, sample: ServerSample, base: ServerSample) -> dict[str, Any]:
        """The KVStats of tiers below device memory; counters count from ``base``."""
        def hits(s: ServerSample) -> float | None:
            return s.offload_hits if s.offload_hits is not None else s.lmcache_hits

        def whole(value: float | None) -> int | None:
            return None if value is None else int(value)

        # What each tier holds: LMCache's local CPU and disk backends, HiCache's host memory.
        tiers = {kind: {"used_bytes": int(held)} for kind, held in (
            ("cpu", sample.lmcache_cpu_bytes), ("disk", sample.lmcache_disk_bytes),
            ("cpu", None if sample.offload_used_tokens is None
             else sample.offload_used_tokens * self.bytes_per_token)) if held is not None}
        held = [t["used_bytes"] for t in tiers.values()]
        return {
            "offload_hit_tokens": whole(_delta(hits(sample), hits(base))),
            "offload_loaded_bytes": whole(_delta(sample.offload_loaded_bytes,
                                                 base.offload_loaded_bytes)),
            "offload_stored_bytes": whole(_delta(sample.offload_stored_bytes,
                                                 base.offload_stored_bytes)),
            "offload_load_s": _delta(sample.offload_load_s, base.offload_load_s),
            "offload_store_s": _delta(sample.offload_store_s, base.offload_store_s),
            "offload_used_bytes": sum(held) if held else None,
            "offload_tiers": tiers or None,
        }

    def _reserved(self, sample: ServerSample) -> int | None:
        if sample.used_tokens is not None:
            return int(sample.used_tokens) * self.bytes_per_token
        if sample.usage is None or self.usable_bytes is None:
            return None
        if self.block_bytes is not None:
            # vLLM's usage is held blocks / usable blocks: recover the whole block count.
            blocks = round(sample.usage * (self.usable_bytes // self.block_bytes))
            return blocks * self.block_bytes
        return round(sample.usage * self.usable_bytes / self.bytes_per_token) * self.bytes_per_token


def _delta(now: float | None, start: float | None) -> float | None:
    """A counter's growth since ``start``; unknown when either reading lacks it (a counter
    first seen mid-run would count the server's whole history)."""
    if now is None or start is None:
        return None
    return now - start
