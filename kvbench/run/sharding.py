"""``kvbench run --shard I/N``: the I-th of N shares of a suite's cases, for CI matrices.

A suite's cases are its engines, in suite order; share I takes cases I, I+N, I+2N, ...
(1-based). Repeats of one engine stay in one share, so their spread is one machine's
spread. A share may be empty (a matrix wider than the suite), which is not an error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvbench.errors import KvbenchError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Shard:
    index: int  # 1-based
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not m:
            raise KvbenchError(f"--shard {text!r}: use I/N, e.g. 1/4")
        index, count = int(m[1]), int(m[2])
        if not 1 <= index <= count:
            raise KvbenchError(f"--shard {text!r}: I must be between 1 and N")
        return cls(index, count)

    def select(self, cases: Sequence[T]) -> list[T]:
        return list(cases[self.index - 1 :: self.count])

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
