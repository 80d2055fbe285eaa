"""Builds engines from a suite's engine section, model, device and KV budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbench.engines.base import Engine
from kvbench.engines.builtin import BuiltinEngine
from kvbench.engines.kv.base import KVManager
from kvbench.engines.presets import ModelPreset
from kvbench.engines.scheduler import SchedulerConfig
from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.run.devices import DeviceSpec
    from kvbench.run.suite import EngineSection


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Everything an engine build needs beyond its section (resolved from the suite + flags)."""

    preset: ModelPreset
    device: DeviceSpec
    kv_bytes: int
    block_size: int
    prefix_caching: bool
    scheduler: SchedulerConfig
    weights: str | None = None
    seed: int = 0
    attention: str = "auto"


def kv_bytes_per_token(opts: EngineOptions) -> int:
    """KV bytes per token summed over tensor-parallel ranks (replicated heads count twice)."""
    return opts.preset.kv_bytes_per_token_per_rank(opts.device.tp) * opts.device.tp


def build_kv_manager(section: EngineSection, opts: EngineOptions) -> KVManager:
    bpt = kv_bytes_per_token(opts)
    max_len = opts.scheduler.max_model_len
    if section.kind == "paged":
        from kvbench.engines.kv.paged import PagedKVManager

        bs = section.block_size or opts.block_size
        num_blocks = opts.kv_bytes // (bs * bpt)
        if num_blocks < 1:
            raise KvbenchError(
                f"KV budget {opts.kv_bytes} bytes holds no {bs}-token block of {bs * bpt} bytes; "
                f"raise --kv-memory to at least {bs * bpt}"
            )
        prefix = opts.prefix_caching if section.prefix_caching is None else section.prefix_caching
        return PagedKVManager(
            num_blocks, bs, bpt, max_len,
            enable_prefix_caching=prefix, leak_finished=section.leak_finished,
        )
    if section.kind == "contiguous":
        from kvbench.engines.kv.contiguous import ContiguousKVManager

        return ContiguousKVManager(
            opts.kv_bytes // bpt, bpt, max_len,
            reservation=section.reservation, fit=section.fit, compaction=section.compaction,
        )
    raise KvbenchError(f"engine kind {section.kind!r} has no KV manager")


def build_engine(name: str, section: EngineSection, opts: EngineOptions) -> Engine:
    if section.kind == "vllm":
        from kvbench.engines.vllm import build_vllm_engine

        return build_vllm_engine(name, section, opts)
    kv = build_kv_manager(section, opts)
    if opts.device.kind == "sim":
        from kvbench.engines.sim_executor import SimExecutor

        executor = SimExecutor(opts.preset.vocab_size, opts.device.label)
    else:
        from kvbench.engines.torch_executor import TorchExecutor

        executor = TorchExecutor(
            opts.preset, device=opts.device.torch_device or "cpu", weights=opts.weights,
            seed=opts.seed, attention=opts.attention,
        )
    return BuiltinEngine(name, opts.preset, kv, opts.scheduler, executor)
