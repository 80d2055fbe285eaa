"""A sequence: one sample of a request moving through the scheduler.

Scheduling follows one rule for prefill, chunked prefill, decode and recompute: a step
computes KV for tokens ``[num_computed_tokens, num_tokens)`` (possibly a chunk of them);
when a sequence's computed tokens reach ``num_tokens`` the step samples one new token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from kvbench.workloads.model import Request


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: Request
    prompt_ids: np.ndarray
    sample_index: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    ever_scheduled: bool = False
    # The prompt never changes: its length is read for every sequence on every step.
    num_prompt_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        """Tokens the sequence will hold when finished (prompt + forced output)."""
        return self.num_prompt_tokens + self.request.output_tokens

    @property
    def is_finished(self) -> bool:
        return len(self.output_ids) >= self.request.output_tokens

    def token_ids(self, start: int, end: int) -> np.ndarray:
        """Token ids at positions ``[start, end)`` (prompt then generated)."""
        n_prompt = self.num_prompt_tokens
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        out = np.asarray(self.output_ids[max(start - n_prompt, 0) : end - n_prompt], np.int64)
        if start >= n_prompt:
            return out
        return np.concatenate([self.prompt_ids[start:], out])
