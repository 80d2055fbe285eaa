"""KV managers: bookkeeping of where each sequence's KV lives (no tensors here)."""

from kvbench.engines.kv.base import KVManager
from kvbench.kernels.slot_copy import SlotCopy

__all__ = ["KVManager", "SlotCopy"]
