"""The sim executor: no tensors. Step time comes from the cost model (read by the virtual
clock from each step's ``BatchShape``); KV is the KV managers' bookkeeping, and the device
memory a real engine would hold for it comes from the device memory model. Sampled tokens
are synthetic ids derived from the request and position, so generated blocks are hashable
for prefix caching exactly as real ones would be."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.engines.base import DeviceMemory
from kvbench.engines.builtin.executor import Executor, ScheduledBatch
from kvbench.engines.kv.base import KVManager
from kvbench.engines.sequence import Sequence
from kvbench.engines.sim.device_memory import DeviceMemoryModel
from kvbench.workloads.model import key_hash

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def synthetic_token(request_id: str, position: int, vocab_size: int) -> int:
    """The token the simulator samples for ``request_id`` at ``position`` (1-based, prompt
    included)."""
    h = (key_hash(request_id) + position * _GOLDEN) & _MASK
    return (h ^ (h >> 29)) % vocab_size


def synthetic_tokens(keys: np.ndarray | np.uint64, positions: np.ndarray,
                     vocab_size: int) -> np.ndarray:
    """:func:`synthetic_token` of requests whose ids hash to ``keys`` at ``positions``
    (broadcast together; uint64 arithmetic wraps as the masked integer one does)."""
    with np.errstate(over="ignore"):
        h = positions * np.uint64(_GOLDEN)
        h += keys
        h ^= h >> np.uint64(29)
        h %= np.uint64(vocab_size)
    return h


class SimExecutor(Executor):
    device = "sim"

    def __init__(self, vocab_size: int, target: str, memory: DeviceMemoryModel) -> None:
        self.vocab_size = vocab_size
        self.target = target
        self.memory = memory
        self._stepped: DeviceMemory | None = None
        self._encoder_bytes = 0

    def bind(self, kv: KVManager) -> None:
        """Nothing to allocate: the pool exists only as the manager's bookkeeping and in the
        memory model, which checks here that the engine can start at all."""
        self.memory.start(kv)

    def execute(self, batch: ScheduledBatch, kv: KVManager) -> list[int]:
        self._stepped = self.memory.step(batch)
        vocab = self.vocab_size
        out = []
        for item in batch.items:
            if item.sample:
                seq = item.seq
                position = seq.num_prompt_tokens + len(seq.output_ids) + 1
                out.append(synthetic_token(seq.request.id, position, vocab))
        return out

    def decode_tokens(self, seqs: list[Sequence], steps: int) -> None:
        """Append to each of ``seqs`` the tokens ``steps`` decode steps sample, the ids
        :meth:`execute` gives them one step at a time (uint64 arithmetic wraps as the
        masked integer one does)."""
        first = np.fromiter((s.num_prompt_tokens + len(s.output_ids) for s in seqs),
                            np.uint64, len(seqs))
        keys = np.fromiter((key_hash(s.request.id) for s in seqs), np.uint64, len(seqs))
        positions = first[:, None] + np.arange(1, steps + 1, dtype=np.uint64)
        h = synthetic_tokens(keys[:, None], positions, self.vocab_size)
        for seq, ids in zip(seqs, h.tolist(), strict=True):
            seq.output_ids.extend(ids)

    def step_memory(self) -> DeviceMemory:
        stepped, self._stepped = self._stepped, None
        out = stepped if stepped is not None else self.memory.idle()
        self._encoder_bytes = out.encoder_bytes
        return out

    def encoder_cache_bytes(self) -> int:
        """Encoder outputs held at the last step's peak (the model frees those no running
        sequence still needs at the step's end)."""
        return self._encoder_bytes

    def close(self) -> None:
        """Nothing to release."""

    def describe(self) -> dict[str, Any]:
        m = self.memory
        return {
            "executor": "sim", "target": self.target,
            "memory_model": {
                "attention_impl": m.options.attention_impl,
                "kv_allocation": m.options.kv_allocation,
                "extra_kv_window_tokens": m.options.extra_kv_window_tokens,
                "device_memory_bytes_per_rank": m.memory_bytes, "tp": m.tp,
            },
        }
