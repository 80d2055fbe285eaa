"""The built-in engine: scheduler + KV manager + executor behind the Engine protocol."""

from __future__ import annotations

from typing import Any

from kvbench.engines.base import (
    BatchShape,
    Finished,
    KVStats,
    StepReport,
    causal_pairs,
    keys_read,
    output_digest,
)
from kvbench.engines.config import EngineConfig
from kvbench.engines.device_memory import DeviceMemoryModel
from kvbench.engines.executor import Executor, ScheduledBatch
from kvbench.engines.kv.base import KVManager
from kvbench.engines.presets import ModelPreset
from kvbench.engines.scheduler import Scheduler, SchedulerConfig
from kvbench.workloads.model import Request


class BuiltinEngine:
    def __init__(
        self,
        name: str,
        preset: ModelPreset,
        kv: KVManager,
        scheduler_config: SchedulerConfig,
        executor: Executor,
    ) -> None:
        self.name = name
        self.preset = preset
        self.kv = kv
        self.scheduler = Scheduler(scheduler_config, kv)
        self.executor = executor
        executor.bind(kv)
        self._rejected: list[Finished] = []
        self._bytes_per_token = kv.bytes_per_token

    @classmethod
    def from_config(cls, config: EngineConfig, kv: KVManager) -> BuiltinEngine:
        """``kv`` backed by the executor of ``config``'s device: the cost model's sim, or real
        compute with torch."""
        executor: Executor
        if config.device.kind == "sim":
            from kvbench.engines.sim_executor import SimExecutor

            executor = SimExecutor(config.preset.vocab_size, config.device.label,
                                   _device_memory_model(config))
        else:
            from kvbench.engines.torch_executor import TorchExecutor

            executor = TorchExecutor(
                config.preset, device=config.device.torch_device or "cpu",
                weights=config.weights, seed=config.seed, attention=config.attention,
            )
        return cls(config.name, config.preset, kv, config.scheduler, executor)

    def add(self, request: Request) -> None:
        reason = self.scheduler.rejection(request)
        if reason is not None:
            self._rejected.append(Finished(request.id, rejected=reason))
            return
        self.scheduler.add(request, request.prompt_token_ids(self.preset.vocab_size))

    def has_unfinished(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished()

    def step(self) -> StepReport:
        sched = self.scheduler
        batch, preempted, first = sched.schedule()
        shape = batch_shape(batch, self._bytes_per_token, self.preset.sliding_window)
        sampled = self.executor.execute(batch, self.kv) if batch.items or batch.copies else []
        device = self.executor.step_memory()
        outcome = sched.update(batch, sampled)
        finished = self._rejected
        self._rejected = []
        for state in outcome.finished:
            digest = None
            if self.executor.device != "sim":
                digest = output_digest([s.output_ids for s in state.samples])
            finished.append(
                Finished(
                    state.request.id,
                    output_digest=digest,
                    cached_tokens=state.samples[0].num_cached_tokens,
                )
            )
        return StepReport(
            tokens=outcome.tokens,
            first_token=outcome.first_token,
            scheduled_first=first,
            finished=finished,
            num_running=sched.num_running_requests,
            num_waiting=len(sched.waiting),
            num_preempted=len(preempted),
            preempted_ids=[s.request.id for s in preempted],
            kv=self._stats(),
            batch=shape,
            device=device,
        )

    def _stats(self) -> KVStats:
        stats = self.kv.stats()
        refusal = self.scheduler.refusal
        stats.refused_bytes = refusal.need_bytes
        stats.refused_free_bytes = refusal.free_bytes
        stats.refused_largest_free_bytes = refusal.largest_free_bytes
        stats.encoder_cache_bytes = self.executor.encoder_cache_bytes()
        return stats

    def close(self) -> None:
        self.executor.close()

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "builtin",
            "kv_manager": self.kv.describe(),
            "scheduler": self.scheduler.config.to_json(),
            "executor": self.executor.describe(),
        }


def batch_shape(
    batch: ScheduledBatch, bytes_per_token: int, window: int | None = None
) -> BatchShape:
    """What the cost model needs to know about ``batch`` (attention limited to the model's
    sliding ``window``, if it has one)."""
    decode = prefill = context = pairs = 0
    for item in batch.items:
        n, start = item.num_tokens, item.start
        if n == 1 and item.seq.output_ids:
            decode += 1
        else:
            prefill += n
        if window is None:
            context += start + n
            pairs += causal_pairs(start, n)
        else:
            context += keys_read(start, n, window)
            pairs += causal_pairs(start, n, window)
    copied = sum(c.num_slots for c in batch.copies) * bytes_per_token if batch.copies else 0
    return BatchShape(
        num_seqs=len(batch.items), prefill_tokens=prefill, decode_tokens=decode,
        context_tokens=context, attn_pairs=pairs, copied_bytes=copied, map_ops=batch.map_ops,
    )


def _device_memory_model(config: EngineConfig) -> DeviceMemoryModel:
    """The memory model of ``config``'s simulated device, one rank of ``device.tp``."""
    sched = config.scheduler
    return DeviceMemoryModel(
        config.preset, config.device.hardware.memory_bytes, config.device.tp, config.memory,
        sched.max_num_batched_tokens, sched.max_num_seqs,
    )
