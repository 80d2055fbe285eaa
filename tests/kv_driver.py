"""A scheduler stand-in for KV manager tests, with a fake KV memory.

Computing a token writes ``position * VOCAB + token id`` into its slot, and queued copies are
applied like an executor would, so reading a sequence's slots back shows any slot handed to
two sequences, any wrong copy-on-write or compaction move, and any bad prefix-cache hit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

from kvbench.engines.kv.base import KVManager
from kvbench.engines.sequence import Sequence
from kvbench.workloads.model import Request, Segment

VOCAB = 7  # small, so that forked samples sometimes pick the same token


def make_seq(
    seq_id: int, prompt: int, output: int, *, prefix: tuple[str, int] | None = None, n: int = 1
) -> Sequence:
    """A sequence whose prompt starts with ``prefix`` = (key, tokens) shared by others."""
    segments = []
    if prefix is not None:
        segments.append(Segment("text", prefix[1], prefix[0]))
    if prompt:
        segments.append(Segment("text", prompt, f"own/{seq_id}"))
    request = Request(f"r{seq_id}", 0.0, tuple(segments), output, n=n)
    return Sequence(seq_id, request, request.prompt_token_ids(VOCAB))


class KVDriver:
    def __init__(self, kv: KVManager, seed: int = 0) -> None:
        self.kv = kv
        self.mem = np.full(kv.capacity_tokens, -1, dtype=np.int64)
        self.rng = np.random.default_rng(seed)
        self.running: list[Sequence] = []
        self.next_id = 1000  # above the ids tests give to their own sequences

    def admit(self, seq: Sequence, chunk: int) -> bool:
        cached = self.kv.lookup_prefix(seq)
        assert 0 <= cached <= seq.num_tokens - 1
        num_new = min(chunk, seq.num_tokens - cached)
        if not self.kv.allocate(seq, cached, num_new):
            return False
        assert seq.num_computed_tokens == seq.num_cached_tokens == cached
        self.running.append(seq)
        self._compute(seq, num_new)
        return True

    def step(self, seq: Sequence, chunk: int) -> bool:
        num_new = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if not self.kv.grow(seq, num_new):
            return False
        self._compute(seq, num_new)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1

    def free(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.running.remove(seq)

    def apply_copies(self) -> None:
        for c in self.kv.take_copies():
            self.mem[c.dst : c.dst + c.num_slots] = self.mem[c.src : c.src + c.num_slots].copy()

    def _compute(self, seq: Sequence, num_new: int) -> None:
        self.apply_copies()
        start = seq.num_computed_tokens
        end = start + num_new
        slots = self.kv.slots(seq, start, end)
        self.mem[slots] = np.arange(start, end) * VOCAB + seq.token_ids(start, end)
        seq.num_computed_tokens = end
        self.kv.commit(seq)
        if end < seq.num_tokens:
            return
        seq.output_ids.append(int(self.rng.integers(VOCAB)))
        if len(seq.output_ids) == 1 and seq.sample_index == 0:
            for j in range(1, seq.request.n):
                self._fork(seq, j)
        if seq.is_finished:
            self.free(seq)

    def _fork(self, parent: Sequence, index: int) -> None:
        child = Sequence(
            self.next_id,
            parent.request,
            parent.prompt_ids,
            sample_index=index,
            output_ids=list(parent.output_ids),
            num_computed_tokens=parent.num_computed_tokens,
        )
        self.next_id += 1
        self.kv.fork(parent, child)
        self.running.append(child)
        if child.is_finished:
            self.free(child)

    def held_from(self, seq: Sequence) -> int:
        """The first position whose KV ``seq`` still holds (a sliding window frees earlier
        ones)."""
        return 0

    def check_contents(self) -> None:
        """Every live sequence reads back exactly its own tokens."""
        self.apply_copies()
        for seq in self.running:
            n, first = seq.num_computed_tokens, self.held_from(seq)
            want = np.arange(first, n) * VOCAB + seq.token_ids(first, n)
            got = self.mem[self.kv.slots(seq, first, n)]
            assert np.array_equal(got, want), f"sequence {seq.seq_id} reads foreign KV"


def random_operations(
    data: st.DataObject, driver: KVDriver, check: Callable[[KVManager, KVDriver], None], *,
    prompt_max: int, output_max: int, chunk_max: int, step_max: int, admit_any: bool = False,
    background: bool = False,
) -> None:
    """Drive ``driver`` through random arrivals (1-3 samples each; each arrives at the manager
    unless it can never fit), admissions (the oldest waiting sequence, or with ``admit_any``
    any), growth (preempting the newest running sequence when it fails), preemptions and,
    with ``background``, the manager's background work, calling ``check`` after each; then
    release everything, running or waiting, and check once more."""
    kv = driver.kv
    ops = ["new", "admit", "step", "step", "step", "preempt"] + (
        ["background"] if background else [])
    waiting: list[Sequence] = []
    for i in range(data.draw(st.integers(1, 60), label="ops")):
        op = data.draw(st.sampled_from(ops))
        if op == "new":
            seq = make_seq(i, data.draw(st.integers(1, prompt_max)),
                           data.draw(st.integers(1, output_max)), n=data.draw(st.integers(1, 3)))
            if kv.never_fits(seq.request) is None:
                kv.arrive(seq)
                waiting.append(seq)
        elif op == "admit" and waiting:
            seq = data.draw(st.sampled_from(waiting)) if admit_any else waiting[0]
            if driver.admit(seq, data.draw(st.integers(1, chunk_max))):
                waiting.remove(seq)
        elif op == "step" and driver.running:
            seq = data.draw(st.sampled_from(driver.running))
            if not driver.step(seq, data.draw(st.integers(1, step_max))):
                victim = driver.running[-1]  # as the scheduler would: the newest one
                driver.preempt(victim)
                waiting.append(victim)
        elif op == "preempt" and driver.running:
            seq = data.draw(st.sampled_from(driver.running))
            driver.preempt(seq)
            waiting.append(seq)
        elif op == "background":
            kv.background()
        check(kv, driver)
    for seq in list(driver.running):
        driver.free(seq)
    for seq in waiting:
        kv.free(seq)  # a hint reserved at arrival goes with it
    check(kv, driver)
