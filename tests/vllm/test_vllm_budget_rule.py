"""kvbench's simulated KV budget against vLLM's own code: the requested memory, and what its
profiler subtracts from it (``kvbench.engines.sim.kv_budget``; no GPU needed)."""

from __future__ import annotations

import math

import pytest

from kvbench.engines.sim.hardware import get_gpu
from kvbench.engines.sim.kv_budget import vllm_kv_budget

GiB = 2**30
UTIL = 0.9


def test_requested_memory_is_vllms_own() -> None:
    """vLLM's ``request_memory`` is the rule's one pure piece (the rest measures a device)."""
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    for name in ("a100-80gb", "h100-sxm", "l40s"):
        total = get_gpu(name).memory_bytes
        for util in (0.9, 0.95, 0.5):
            snapshot = MemorySnapshot(total_memory=total, free_memory=total, device="cpu",
                                      auto_measure=False)
            ours = vllm_kv_budget(total, util, weights_bytes=0, activation_peak_bytes=0,
                                  non_torch_bytes=0)
            assert ours.requested_bytes == request_memory(
                snapshot, CacheConfig(gpu_memory_utilization=util))


class _FakeDevice:
    """The device readings vLLM's ``MemorySnapshot`` takes (``torch.accelerator``), driven by
    hand: a CUDA context made before the snapshot, then weights, a profile forward whose
    activations come and go, and non-torch memory that grows meanwhile."""

    def __init__(self, total: int, context: int) -> None:
        self.total, self.non_torch = total, context
        self.allocated = self.peak = self.reserved = 0

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        acc = torch.accelerator
        monkeypatch.setattr(acc, "memory_stats", lambda *a: {
            "allocated_bytes.all.peak": self.peak, "allocated_bytes.all.current": self.allocated})
        monkeypatch.setattr(acc, "get_memory_info", lambda *a: (
            self.total - self.reserved - self.non_torch, self.total))
        monkeypatch.setattr(acc, "memory_reserved", lambda *a: self.reserved)
        monkeypatch.setattr(acc, "empty_cache", lambda: setattr(self, "reserved", self.allocated))
        monkeypatch.setattr(acc, "reset_peak_memory_stats",
                            lambda *a: setattr(self, "peak", self.allocated))


def test_the_terms_are_what_vllms_profiler_subtracts(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own ``memory_profiling`` over a device with known contents takes weights,
    activation peak and non-torch growth from the request, and leaves the context out."""
    from vllm.utils.mem_utils import MemorySnapshot, memory_profiling

    total, context, weights, activations, non_torch = 80 * GiB, GiB // 2, 15 * GiB, GiB, GiB // 8
    dev = _FakeDevice(total, context)
    dev.patch(monkeypatch)
    start = MemorySnapshot(device="cpu")  # the worker's, after the context exists
    dev.allocate(weights)
    with memory_profiling(start, weights_memory=weights) as result:
        dev.allocate(activations)
        dev.non_torch += non_torch
        dev.allocate(-activations)
    vllm_kv = math.ceil(total * UTIL) - result.non_kv_cache_memory
    ours = vllm_kv_budget(total, UTIL, weights_bytes=weights, activation_peak_bytes=activations,
                          non_torch_bytes=non_torch)
    assert ours.kv_bytes == vllm_kv
