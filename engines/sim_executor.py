"""The sim executor: no tensors. Step time comes from the cost model (read by the virtual
clock from each step's ``BatchShape``); memory is the KV managers' bookkeeping. Sampled
tokens are synthetic ids derived from the request and position, so generated blocks are
hashable for prefix caching exactly as real ones would be."""

from __future__ import annotations

from typing import Any

from kvbench.engines.executor import Executor, ScheduledBatch
from kvbench.engines.kv.base import KVManager
from kvbench.workloads.model import key_hash

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


class SimExecutor(Executor):
    device = "sim"

    def __init__(self, vocab_size: int, target: str) -> None:
        self.vocab_size = vocab_size
        self.target = target

    def bind(self, kv: KVManager) -> None:
        """Nothing to allocate: the simulated pool exists only as the manager's bookkeeping."""

    def execute(self, batch: ScheduledBatch, kv: KVManager) -> list[int]:
        vocab = self.vocab_size
        out = []
        for item in batch.items:
            if item.sample:
                seq = item.seq
                position = seq.num_prompt_tokens + len(seq.output_ids) + 1
                h = (key_hash(seq.request.id) + position * _GOLDEN) & _MASK
                out.append((h ^ (h >> 29)) % vocab)
        return out

    def close(self) -> None:
        """Nothing to release."""

    def describe(self) -> dict[str, Any]:
        return {"executor": "sim", "target": self.target}
