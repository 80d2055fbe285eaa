"""A paged engine that holds 256 MiB of touched memory from when it is built until its
process ends: the isolation tests' way to tell whether a later engine inherits an earlier
one's allocations. A module of its own so that an engine process can import it."""

from __future__ import annotations

import numpy as np

from kvbench.engines.config import EngineConfig
from kvbench.engines.kv.paged import PagedKVManager, PagedPolicy

BALLAST_BYTES = 256 << 20
# Kept for the life of the process that built the engine (the allocation under test).
HELD: list[np.ndarray] = []


class BallastPaged(PagedPolicy):
    # The engine is built over a fresh manager: the ballast is taken as it is.
    def manager(self, config: EngineConfig) -> PagedKVManager:
        HELD.append(np.ones(BALLAST_BYTES, dtype=np.uint8))
        return super().manager(config)
