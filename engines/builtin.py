"""The built-in engine: scheduler + KV manager + executor behind the Engine protocol."""

from __future__ import annotations

import time
from typing import Any

from kvbench.engines.base import BatchShape, Finished, StepReport
from kvbench.engines.executor import Executor
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

    def rejection(self, request: Request) -> str | None:
        return self.scheduler.rejection(request)

    def add(self, request: Request) -> None:
        reason = self.scheduler.rejection(request)
        if reason is not None:
            self._rejected.append(Finished(request.id, rejected=reason))
            return
        self.scheduler.add(request, request.prompt_token_ids(self.preset.vocab_size))

    def has_unfinished(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished()

    def step(self) -> StepReport:
        t0 = time.perf_counter()
        sched = self.scheduler
        batch, preempted, first = sched.schedule()
        shape = BatchShape(num_seqs=len(batch.items))
        for item in batch.items:
            end = item.start + item.num_tokens
            if item.num_tokens == 1 and item.seq.output_ids:
                shape.decode_tokens += 1
            else:
                shape.prefill_tokens += item.num_tokens
            shape.context_tokens += end
            # Causal: query i of the chunk sees start + i + 1 keys.
            shape.attn_pairs += item.num_tokens * item.start + item.num_tokens * (
                item.num_tokens + 1
            ) // 2
        shape.copied_bytes = sum(c.num_slots for c in batch.copies) * self._bytes_per_token
        sampled = self.executor.execute(batch, self.kv) if batch.items or batch.copies else []
        outcome = sched.update(batch, sampled)
        finished = self._rejected
        self._rejected = []
        for state in outcome.finished:
            digest = None
            if self.executor.device != "sim":
                digest = _digest([s.output_digest() for s in state.samples])
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
            kv=self.kv.stats(),
            batch=shape,
            elapsed_s=time.perf_counter() - t0,
        )

    def close(self) -> None:
        self.executor.close()

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "builtin",
            "kv_manager": self.kv.describe(),
            "scheduler": self.scheduler.config.to_json(),
            "executor": self.executor.describe(),
        }


def _digest(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "+".join(parts)
