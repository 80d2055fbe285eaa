"""The page classes of a modality-aware KV pool (:mod:`kvbench.engines.kv.modal`): each
class's page size, storage dtype and slots, and a batch's page tables class by class.

A module of their own, below the policy, so that the modality accounting and the executor's
class pools read them without importing the policy and its engine configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Storage dtypes a class may use: bytes per element.
KV_DTYPES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1,
}
QUANTISED = ("int8", "fp8_e4m3")
SCALE_BYTES = 4  # one float32 scale


@dataclass(frozen=True, slots=True)
class PoolClass:
    """One page class: its modalities, page size, storage dtype, and where its slots lie in
    the manager's flat slot space (``base`` .. ``base + num_slots``). ``bytes_per_token`` is
    the codes' (all layers, K and V); ``scale_group`` slots share one scale per KV head, K
    and V apart, ``scale_units`` scales per group (layers x 2 x KV heads), 0 for floats.
    ``pool`` is the allocator its pages come from (0 for both classes of a shared pool, the
    class's index when split): classes of one pool address the same bytes."""

    name: str
    holds: tuple[str, ...]
    page_tokens: int
    dtype: str
    bytes_per_token: int
    base: int
    num_slots: int
    scale_group: int
    scale_units: int
    pool: int = 0

    @property
    def quantised(self) -> bool:
        return self.dtype in QUANTISED

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token

    @property
    def scale_bytes(self) -> int:
        """Bytes of the class's scale table (every slot it can address)."""
        if not self.quantised:
            return 0
        return self.num_slots // self.scale_group * self.scale_units * SCALE_BYTES

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "holds": list(self.holds), "page_tokens": self.page_tokens,
            "dtype": self.dtype, "bytes_per_token": self.bytes_per_token,
            "num_slots": self.num_slots, "scale_group": self.scale_group,
            "scale_bytes": self.scale_bytes,
        }


@dataclass(frozen=True, slots=True)
class ClassTables:
    """A batch's KV, class by class: ``tables[k]`` ``[B, max_pages]`` int32 of class ``k``'s
    pages (class-local page ids) and ``context_lens[k]`` ``[B]`` its positions among each
    sequence's context."""

    tables: tuple[Any, ...]
    context_lens: tuple[Any, ...]
    classes: tuple[PoolClass, ...]

    def on(self, device: Any) -> ClassTables:
        import torch

        def to(a: Any, dtype: torch.dtype) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, dtype)

        return ClassTables(tuple(to(t, torch.int32) for t in self.tables),
                           tuple(to(n, torch.int32) for n in self.context_lens), self.classes)
