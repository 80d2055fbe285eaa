"""KV-cache kernels (store, paged and contiguous attention, slot copies, merging partial
attention) and their backends."""

from typing import Any

from kvbench.kernels.slot_copy import SlotCopy

__all__ = ["KernelBackend", "SlotCopy", "backend_names", "get_backend"]


def __getattr__(name: str) -> Any:
    # The backends import torch: loaded on first use, so that reading the layouts and
    # slot copies (engine bookkeeping, the CLI) stays torch-free.
    if name in {"KernelBackend", "backend_names", "get_backend"}:
        from kvbench.kernels import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
