"""KV-cache kernels (store, paged and contiguous attention, slot copies, merging partial
attention) and their backends."""

# The backends (kvbench.kernels.backend) import torch: not imported here, so that reading the
# layouts and slot copies (engine bookkeeping, the CLI) stays torch-free.
from kvbench.kernels.slot_copy import SlotCopy

__all__ = ["SlotCopy"]
