"""The executor interface: runs one scheduled batch (real compute or a cost model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from kvbench.engines.base import DeviceMemory
from kvbench.engines.kv.base import KVManager
from kvbench.engines.sequence import Sequence
from kvbench.kernels.slot_copy import SlotCopy


@dataclass(slots=True)
class ScheduledSeq:
    """Compute KV for positions ``[start, start + num_tokens)`` of ``seq``; then, if
    ``sample``, produce the next token from the last position's logits."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool


@dataclass(slots=True)
class ScheduledBatch:
    """A step's work: the sequences to compute, the KV copies to apply first, and the
    mapping operations the KV manager did on the step's critical path."""

    items: list[ScheduledSeq] = field(default_factory=list)
    copies: list[SlotCopy] = field(default_factory=list)
    map_ops: int = 0
    load_s: float = 0.0
    load_layerwise: bool = False


class Executor(ABC):
    """Backs a KV manager's slots with memory and computes scheduled batches."""

    device: str

    @abstractmethod
    def bind(self, kv: KVManager) -> None:
        """Allocate the physical KV pool for ``kv`` (called once before the first step)."""

    @abstractmethod
    def execute(self, batch: ScheduledBatch, kv: KVManager) -> list[int]:
        """Apply ``batch.copies``, compute every item, return one token id per sampling item
        (in batch order)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]: ...

    def step_memory(self) -> DeviceMemory | None:
        """Device memory at the peak of the step just taken, where the executor models it
        (the simulator); None where it is measured instead (telemetry probes)."""
        return None

    def encoder_cache_bytes(self) -> int | None:
        """Bytes of encoder outputs kept for reuse now (None where not known)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release device memory."""
