"""KV-cache kernels (store, paged and contiguous attention, slot copies, merging partial
attention) and their backends."""

from kvbench.kernels.backend import KernelBackend, backend_names, get_backend
from kvbench.kernels.slot_copy import SlotCopy

__all__ = ["KernelBackend", "SlotCopy", "backend_names", "get_backend"]
