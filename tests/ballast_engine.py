"""A paged engine that holds 256 MiB of touched memory from when it is built until its
process ends: the isolation tests' way to tell whether a later engine inherits an earlier
one's allocations. A module of its own so that an engine process can import it."""

from __future__ import annotations

import numpy as np

from kvbench.engines.base import Engine
from kvbench.engines.config import EngineConfig
from kvbench.engines.kv.paged import PagedPolicy

BALLAST_BYTES = 256 << 20
# Kept for the life of the process that built the engine (the allocation under test).
HELD: list[np.ndarray] = []


class BallastPaged(PagedPolicy):
    def build(self, config: EngineConfig) -> Engine:
        HELD.append(np.ones(BALLAST_BYTES, dtype=np.uint8))
        return super().build(config)
