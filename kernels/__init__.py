"""KV-cache kernels (store, paged and contiguous attention, slot copies) and their backends."""

from kvbench.kernels.backend import KernelBackend, backend_names, get_backend

__all__ = ["KernelBackend", "backend_names", "get_backend"]
