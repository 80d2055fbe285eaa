"""A request's sequence in the event replay, held lazily while it decodes."""

from __future__ import annotations

from array import array

import numpy as np

from kvbench.workloads.model import Request, key_hash


class Seq:
    """One request (one sample) moving through the replay.

    While it decodes steadily (``decoding``: each step computes the token sampled in the step
    before and samples the next), its computed tokens before step ``s`` are ``s + c``, and
    its output tokens ``s + c + 1 - num_prompt``: nothing about it changes step by step.
    Otherwise ``computed`` and ``out`` hold them. ``order`` is its place in the running
    list (admission order); ``fin`` the step that samples its last token while decoding.
    The KV books keep their own fields here: a paged table, its indexed blocks and chained
    hashes; a contiguous extent."""

    __slots__ = (
        "c", "cached", "computed", "decoding", "fin", "final_len", "hashes", "indexed",
        "key", "length", "num_prompt", "order", "out", "phase", "preemptions", "private",
        "prompt_ids", "request", "rid", "run_start", "running", "scheduled", "start",
        "swapped", "table", "target",
    )

    def __init__(self, request: Request, private: bool = False) -> None:
        self.request = request
        # No other request's prompt starts as this one's does: nothing but this request can
        # ever find its blocks in a prefix cache.
        self.private = private
        self.rid = request.id
        self.num_prompt = request.prompt_tokens
        self.target = request.output_tokens
        self.final_len = self.num_prompt + self.target - 1
        self.key = 0
        self.prompt_ids: np.ndarray | None = None
        self.out = self.computed = self.c = self.cached = self.preemptions = 0
        self.order = self.fin = self.phase = -1
        # Preempted with its KV swapped out to an offload tier: it resumes where it stopped.
        self.decoding = self.running = self.scheduled = self.swapped = False
        self.run_start: int | None = None
        self.table: list[int] | array | None = None  # as its pool hands blocks out
        self.indexed = 0
        self.hashes: np.ndarray | None = None
        self.start = self.length = 0

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens (valid while not decoding)."""
        return self.num_prompt + self.out

    def computed_at(self, step: int) -> int:
        """Tokens computed before ``step``."""
        return step + self.c if self.decoding else self.computed

    def token_ids(self, start: int, end: int, vocab_size: int) -> np.ndarray:
        """Token ids at positions ``[start, end)``: the prompt's, then those the simulator
        samples (:func:`~kvbench.engines.builtin.sim_executor.synthetic_token`)."""
        from kvbench.engines.builtin.sim_executor import synthetic_tokens

        n = self.num_prompt
        if self.prompt_ids is None:
            self.prompt_ids = self.request.prompt_token_ids(vocab_size)
        if end <= n:
            return self.prompt_ids[start:end]
        if not self.key:
            self.key = key_hash(self.rid)
        lo = max(start, n)
        gen = synthetic_tokens(np.uint64(self.key),
                               np.arange(lo + 1, end + 1, dtype=np.uint64), vocab_size)
        if start >= n:
            return gen
        return np.concatenate([self.prompt_ids[start:], gen.astype(np.int64)])
