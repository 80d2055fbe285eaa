"""KV managers: bookkeeping of where each sequence's KV lives (no tensors here)."""

from kvbench.engines.kv.base import KVManager, SlotCopy

__all__ = ["KVManager", "SlotCopy"]
