"""The slot-range copy that KV managers hand to executors and ``copy_slots`` applies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SlotCopy:
    """Copy ``num_slots`` token slots from ``src`` to ``dst`` before the step's compute.

    Used for copy-on-write of a shared partial block, contiguous compaction and contiguous
    fork. Ranges may overlap (compaction slides left); copies behave as if read through a
    temporary.
    """

    src: int
    dst: int
    num_slots: int
