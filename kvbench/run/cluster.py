"""Runs of many replicas (``[cluster]`` in a suite, ``--replicas`` / ``--prefill-replicas``
+ ``--decode-replicas``): what a plan checks before building one, and its step log. The
cluster itself is :mod:`kvbench.engines.cluster.engine`; the run builds it
(:func:`kvbench.run.execute.build_cluster`)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from typing import Any

from kvbench.engines.cluster.engine import ClusterEngine, ClusterLog, ClusterSection
from kvbench.engines.config import EngineConfig, KVPolicy
from kvbench.engines.registry import build_engine
from kvbench.engines.sim.hardware import DeviceSpec
from kvbench.errors import KvbenchError
from kvbench.workloads.model import Request


def check_cluster(cluster: ClusterSection, device: DeviceSpec, clock: str,
                  engines: Sequence[tuple[str, EngineConfig]], requests: Sequence[Request]
                  ) -> None:
    """A cluster simulates its replicas: a simulated device, the virtual clock and built-in
    engines only."""
    if not cluster.active:
        return
    shape = (f"{cluster.prefill_replicas} prefill + {cluster.decode_replicas} decode replicas"
             if cluster.disaggregated else f"{cluster.replicas} replicas")
    if device.kind != "sim" or clock != "virtual":
        raise KvbenchError(f"{shape} run on one virtual clock: use --device sim:GPU "
                           f"(not {device.label}) and the virtual clock")
    for name, config in engines:
        if not isinstance(config.section, KVPolicy):
            raise KvbenchError(f"engine {name!r} ({config.section.kind}) is not a built-in "
                               f"engine: {shape} replicate built-in KV policies only")
    if cluster.disaggregated:
        many = [r.id for r in requests if r.n > 1]
        if many:
            raise KvbenchError(f"disaggregated prefill runs one sample per request; "
                               f"{len(many)} requests have n > 1 (first: {many[0]})")


def cluster_log(engine: Any) -> ClusterLog | None:
    return engine.log if isinstance(engine, ClusterEngine) else None


# What a replica adds to a run besides its engine, per request of the workload: its column of
# the cluster's step log and its record curves. Source: tracemalloc peaks of quick-sim runs
# (mixed-text, 50-400 requests, 10-80 replicas) less the engines, 8.1-9.6 KB per replica and
# request; rounded down, so the estimate is a floor.
REPLICA_BYTES_PER_REQUEST = 8 * 1024


def check_replica_memory(
    cluster: ClusterSection, engines: Sequence[tuple[str, EngineConfig]], num_requests: int
) -> None:
    """Refuse, before any is built, replicas that would need more than this machine's
    memory. A replica's engine is measured (one is built under tracemalloc): its KV
    bookkeeping grows with its pool's pages, by an amount that differs per policy."""
    from kvbench.units import format_bytes
    from kvbench.workloads.limits import memory_limit_bytes

    limit = memory_limit_bytes()
    if not cluster.active or limit is None:
        return
    count = cluster.num_replicas
    for name, config in engines:
        if not isinstance(config.section, KVPolicy):
            continue  # not replicated: check_cluster refuses it
        each = _engine_heap_bytes(config) + REPLICA_BYTES_PER_REQUEST * num_requests
        if count * each > limit:
            raise KvbenchError(
                f"engine {name!r}: {count:,} replicas would need about "
                f"{format_bytes(count * each)} of memory ({format_bytes(each)} each: its KV "
                f"bookkeeping, measured, and its share of the run's step log for "
                f"{num_requests:,} requests), more than this machine's {format_bytes(limit)}; "
                f"use at most about {limit // each:,} replicas"
            )


def _engine_heap_bytes(config: EngineConfig) -> int:
    """The heap one engine of ``config`` holds once built."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    engine = build_engine(config)
    try:
        return max(0, tracemalloc.get_traced_memory()[0] - before)
    finally:
        engine.close()
        if started:
            tracemalloc.stop()
