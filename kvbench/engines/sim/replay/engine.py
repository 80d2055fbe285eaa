"""The event replay: a built-in engine's scheduler, KV bookkeeping, sim executor and device
memory model, replayed at a cost per event instead of per running sequence.

It takes the same decisions as :class:`~kvbench.engines.builtin.scheduler.Scheduler` over the same
KV policy, in the same order, and reports what :meth:`BuiltinEngine.step` would report at
every step (``--no-fast-forward`` runs that reference, and tests hold both to bit-identical
records). What differs is how the work is held:

- a decoding sequence is not touched while it decodes
  (:class:`~kvbench.engines.sim.replay.seq.Seq`);
  sums over the running set are kept as they change, and the KV books index decoders by
  the steps at which they allocate or fill a block;
- a step costs its events: admissions and prefill chunks, the few allocations and prefix
  entries of that step's decoders, finishes, preemptions;
- a run of steps with no event at all (a quiet stretch: every running sequence decodes, none
  finishes, no allocation can fail, nobody can be admitted) is taken in one go, its
  per-step values computed with numpy, as decode fast-forward did.

Scope: one sample per request, text prompts, the ``paged`` (without sliding-window release)
and ``contiguous`` policies, KV
preallocated on the simulated device,
and a token budget above ``max_num_seqs`` (so decodes always fit a step). Anything else
runs step by step (:func:`~kvbench.engines.sim.replay.replay_blocker` says why).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import deque
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvbench.engines.base import (
    MAX_DECODE_RUN,
    BatchShape,
    DeviceMemory,
    Finished,
    KVStats,
    causal_pairs,
    keys_read,
)
from kvbench.engines.kv.modality import ModalityAccount
from kvbench.engines.sim.activations import ForwardShape
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.replay.block import INDEX, Arrivals, StepBlock
from kvbench.engines.sim.replay.seq import Seq
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.workloads.model import Request

if TYPE_CHECKING:
    from kvbench.engines.builtin.engine import BuiltinEngine

# A step that computes nothing and ends nothing, this many times in a row, is a stuck
# scheduler (the harness's rule for engines it steps one at a time).
MAX_IDLE_STEPS = 1000
# A block returns after this much wall time, so that progress and interrupts are timely.
BLOCK_WALL_S = 0.25
# Requests whose sequences are made (and their prompts keyed) together ahead of arriving,
# at most this many, or this many prompt tokens.
PREPARE_REQUESTS = 256
PREPARE_TOKENS = 1 << 20


class Book(Protocol):
    """KV bookkeeping (:mod:`~kvbench.engines.sim.replay.paged`,
    :mod:`~kvbench.engines.sim.replay.contiguous`)."""

    bpt: int
    page_bytes: int
    page_tokens: int
    footprint: Any
    tier_kinds: tuple[str, ...]

    def join(self, seq: Seq) -> None: ...
    def leave(self, seq: Seq) -> None: ...
    def grows_at(self, step: int) -> list[Seq]: ...
    def grow_decoders(self, seqs: list[Seq]) -> None: ...
    def fill_decoders(self, step: int) -> None: ...
    def advance(self, tokens: int) -> None: ...
    def fresh(self, seq: Seq, pos: int, num_new: int) -> int: ...
    def fits(self, blocks: int) -> bool: ...
    def grow(self, seq: Seq, pos: int, num_new: int) -> bool: ...
    def lookup(self, seq: Seq) -> tuple[int, list[int]]: ...
    def would_admit(self, seq: Seq, cached: int, hits: list[int],
                    num_new: int) -> bool | None: ...
    def allocate(self, seq: Seq, cached: int, hits: list[int], num_new: int,
                 step: int) -> bool: ...
    def commit(self, seq: Seq, before: int, after: int) -> None: ...
    def swap_out(self, seq: Seq, committed: int) -> bool: ...
    def free(self, seq: Seq, finished: bool, committed: int, step: int) -> None: ...
    def take_copies(self) -> list[SlotCopy]: ...
    def copies_pending(self) -> bool: ...
    def take_load_s(self) -> float: ...
    def held(self) -> tuple[int, ...]: ...
    def values(self) -> tuple[Any, ...]: ...
    def mark(self) -> tuple[Any, ...]: ...
    def stats(self, mark: tuple[Any, ...] | None = None) -> KVStats: ...
    def free_now(self) -> tuple[int, int]: ...
    def shared_tokens(self) -> int: ...
    def prepare(self, seqs: list[Seq]) -> None: ...
    def waiting_hashes(self, seq: Seq) -> set[int] | None: ...
    def room(self, step: int, max_steps: int, keep_cached: bool,
             plan: list[tuple[int, list[Seq]]], before: np.ndarray | None) -> int: ...
    def fill_stop(self, step: int, steps: int, avoid: set[int]) -> int: ...
    def quiet(self, step: int, steps: int, n: int
              ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]: ...


_NO_REFUSAL = (0, 0, 0)


class EventReplay:
    """Drives the steps of ``engine`` (a built-in engine on a simulated device, not yet
    stepped) under the virtual clock's ``cost`` model."""

    def __init__(self, engine: BuiltinEngine, cost: CostModel, book: Book,
                 shared: set[str] | None = None) -> None:
        config = engine.scheduler.config
        self.name = engine.name
        self.rejection = engine.scheduler.rejection
        self.max_seqs = config.max_num_seqs
        self.token_budget = config.max_num_batched_tokens
        self.chunked = config.chunked_prefill
        self.window = engine.preset.sliding_window
        self.cost = cost
        self.load_layerwise = engine.kv.load_layerwise
        self.memory = engine.executor.memory  # type: ignore[attr-defined]
        self.acts = self.memory.activations
        self.book = book
        self.bpt = book.bpt
        # Prompt starts shared between requests (None: count every prompt as shared).
        self._shared = shared
        self.modalities = ModalityAccount(None, engine.kv.spec, engine.preset.dtype)
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.rejected: list[Finished] = []
        # Sequences made ahead of their arrival, or why a request will be rejected, by id.
        self._ready: dict[str, Seq | str] = {}
        self._ready_upto: tuple[list[Request] | None, int] = (None, 0)
        self.step = 0
        self._order = 0
        # Decoders: how many, the sum of their offsets c, and when each samples its last
        # token (a heap, stale entries skipped); the computed tokens of running sequences
        # that are not decoding.
        self.n_dec = 0
        self.sum_c = 0
        self._pace = 0.0  # the last decode step's length, to guess how far arrivals are
        # The last step's refusal, encoder outputs and text KV bytes (for its snapshot).
        self._last: tuple[tuple[int, int, int], int, int | None] = (_NO_REFUSAL, 0, None)
        self._finishes: list[tuple[int, int, Seq]] = []
        self.sum_partial = 0
        self.idle = 0

    # --- the Engine side ---------------------------------------------------------------

    def add(self, request: Request) -> None:
        got = self._ready.pop(request.id, None)
        if got is None:
            reason = self.rejection(request)
            got = reason if reason is not None else self._seq(request)
        if isinstance(got, str):
            self.rejected.append(Finished(request.id, rejected=got))
        else:
            self.waiting.append(got)

    def _seq(self, request: Request) -> Seq:
        shared = self._shared
        first = request.segments[0]
        return Seq(request, shared is not None and first.key not in shared
                   and first.tokens >= self.book.page_tokens)

    def _prepare(self, requests: list[Request], idx: int) -> None:
        """Make the sequences of the next of ``requests`` from ``idx`` on ahead of their
        arrival (not of those that will be rejected)."""
        seqs: list[Seq] = []
        ready: dict[str, Seq | str] = {}
        tokens = 0
        end = min(idx + PREPARE_REQUESTS, len(requests))
        for i in range(idx, end):
            request = requests[i]
            reason = self.rejection(request)
            if reason is not None:
                ready[request.id] = reason
                continue
            seq = ready[request.id] = self._seq(request)
            seqs.append(seq)
            tokens += seq.num_prompt
            if tokens >= PREPARE_TOKENS:
                end = i + 1
                break
        self.book.prepare(seqs)
        self._ready = ready
        self._ready_upto = (requests, end)

    def has_unfinished(self) -> bool:
        return bool(self.rejected or self.waiting or self.running)

    def advance(self, t: float, arrivals: Arrivals) -> StepBlock:
        """Steps from clock time ``t``, sending ``arrivals`` as they come (the harness's
        rules: a request is added before the first step starting at or after its arrival,
        and while nothing is left to run the clock waits for the next one), until the wave
        has drained or a block's wall time is up; at least one step unless the wave has
        nothing left."""
        block = StepBlock(self.step, t, self.bpt, self.book.page_bytes, self.book.tier_kinds)
        deadline = time.perf_counter() + BLOCK_WALL_S
        before: tuple[Any, ...] | None = None
        requests, n = arrivals.requests, len(arrivals.requests)
        try:
            while True:
                while (arrivals.idx < n and requests[arrivals.idx].arrival_s <= t
                       and arrivals.in_flight < arrivals.limit):
                    request = requests[arrivals.idx]
                    if self._ready_upto[0] is not requests or arrivals.idx >= self._ready_upto[1]:
                        self._prepare(requests, arrivals.idx)
                    if arrivals.send_late and request.arrival_s < t:
                        request = dataclasses.replace(request, arrival_s=t)
                        block.sent.append(request)
                    self.add(request)
                    arrivals.in_flight += 1
                    arrivals.idx += 1
                if not self.has_unfinished():
                    if arrivals.idx >= n:
                        break
                    t = max(t, requests[arrivals.idx].arrival_s)
                    continue
                due = arrivals.due()
                held = arrivals.idx < n and arrivals.in_flight >= arrivals.limit
                t_quiet = self._quiet(block, t, due, held)
                if t_quiet is None:
                    # The snapshot so far, should this step fail half-way (out of memory).
                    before = self.book.mark()
                    t, ended = self._event_step(block, t)
                    arrivals.in_flight -= ended
                    if self.idle >= MAX_IDLE_STEPS:
                        before = None  # a failure here comes after a whole step
                        t = self._stuck(t, arrivals.due())
                else:
                    t = t_quiet
                if time.perf_counter() > deadline:
                    break
        except BaseException as exc:  # what stopped it comes back with the steps taken
            block.error = exc
        if block.steps:
            block.last_kv = self._last_kv(before if block.error is not None else None)
            self._runs_of(block)
        block.t_end = t
        return block.close()

    # --- one step with events ------------------------------------------------------------

    def _event_step(self, block: StepBlock, t0: float) -> tuple[float, int]:
        """One step with events, as the engine's step takes it; returns its end time and
        the requests it ended."""
        s = self.step
        items: list[tuple[Seq, int, int, bool]] = []
        preempted: list[Seq] = []
        runs: list[tuple[str, int, int]] = []
        scheduled: list[str] = []
        refusal = self._schedule(s, items, preempted, runs, scheduled)
        copies = self.book.take_copies()
        dt, device, num_tokens, stall = self._batch(s, items, copies, self.book.take_load_s())
        if stall is not None:
            block.stalls.append(stall)
        t1 = t0 + dt
        first_tokens, finished = self._computed(s, items, t1, runs)
        values = self.book.values()
        n_run = len(self.running)
        text = self._text_bytes(s + 1, values[2])
        encoder = device.encoder_bytes
        block.row((
            t1, t1 - t0, num_tokens, n_run, len(self.waiting), len(preempted), *values, *refusal,
            encoder, text, *((0, 0) if text is not None else (None, None)),
            *device.row(),
        ), self.book.held())
        block.runs += runs
        block.scheduled += [(rid, t0) for rid in scheduled]
        block.first_tokens += first_tokens
        block.preempted += [q.rid for q in preempted]
        block.finished += finished
        if finished:
            block.ended.append((s, len(finished)))
        self._last = (refusal, encoder, text)
        block.device_ranks = device.tp
        self.step = s + 1
        self.idle = self.idle + 1 if num_tokens == 0 and not finished else 0
        return t1, len(finished)

    def _stuck(self, t: float, due: float) -> float:
        """After ``MAX_IDLE_STEPS`` steps without progress: wait for the next request that
        can be sent (``due``), as the harness does; with none, fail."""
        if due == np.inf:
            raise RuntimeError(
                f"engine {self.name!r} made no progress for {self.idle} steps "
                f"({len(self.waiting)} waiting, {len(self.running)} running)")
        self.idle = 0
        return max(t, due)

    def _schedule(self, s: int, items: list[tuple[Seq, int, int, bool]], preempted: list[Seq],
                  runs: list[tuple[str, int, int]], scheduled: list[str]) -> tuple[Any, ...]:
        """Step ``s``'s schedule: decoders' blocks, the partial prefill's next chunk (or
        preemptions where they do not fit), then admissions; returns the refusal values."""
        book, running = self.book, self.running
        budget = self.token_budget - self.n_dec
        partial = running[-1] if running and not running[-1].decoding else None
        grows = book.grows_at(s)
        num_new = 0
        if partial is not None:
            start = partial.computed
            num_new = partial.num_tokens - start
            if num_new > budget:
                num_new = budget if self.chunked else 0
        need = len(grows) + (book.fresh(partial, partial.computed, num_new) if num_new else 0)
        if need and not book.fits(need):
            budget = self._schedule_running(s, items, preempted, runs)
        else:
            if grows:
                book.grow_decoders(grows)
            if num_new:
                assert partial is not None
                book.grow(partial, start, num_new)
                items.append((partial, start, num_new, start + num_new == partial.num_tokens))
                budget -= num_new
        if preempted:
            return _NO_REFUSAL
        return self._admit(s, budget, items, scheduled)

    def _batch(self, s: int, items: list[tuple[Seq, int, int, bool]], copies: list[SlotCopy],
               load_s: float) -> tuple[float, Any, int, float | None]:
        """Step ``s``'s batch (every decoder, then the prefill chunks) after ``load_s`` of
        loads from offload tiers: its time, the device memory it takes, its tokens, and the
        time it stalls on the loads (None without loads)."""
        running, n_dec, window = self.running, self.n_dec, self.window
        decode, prefill, num_tokens, sampled = n_dec, 0, n_dec, n_dec
        if window is None:
            context = n_dec * (s + 1) + self.sum_c
            pairs = context
        else:
            context = pairs = sum(min(s + q.c + 1, window) for q in running if q.decoding)
        chunks = []
        longest, decode_pairs = 0, pairs
        for seq, start, n, sample in items:
            end = start + n
            num_tokens += n
            sampled += sample
            item_pairs = causal_pairs(start, n, window)
            if n == 1 and seq.out:
                decode += 1
                decode_pairs += item_pairs
                longest = max(longest, end)
            else:
                prefill += n
                chunks.append((n, end))
            context += keys_read(start, n, window)
            pairs += item_pairs
        copied = sum(c.num_slots for c in copies) * self.bpt if copies else 0
        num_seqs = n_dec + len(items)
        batch = BatchShape(
            num_seqs=num_seqs, prefill_tokens=prefill, decode_tokens=decode,
            context_tokens=context, attn_pairs=pairs, decode_pairs=decode_pairs,
            copied_bytes=copied, load_s=load_s, load_layerwise=self.load_layerwise)
        dt = self.cost.step_time_s(batch)
        stall = self.cost.load_stall_s(batch) if load_s else None
        if not (num_seqs or copies):
            return dt, self.memory.idle(), num_tokens, stall
        if n_dec and self.acts.attention != "fused":
            longest = max(longest, s + 1 + max(q.c for q in running if q.decoding))
        shape = ForwardShape(num_tokens, sampled, tuple(chunks), decode, longest)
        return dt, self.memory.step_shape(shape), num_tokens, stall

    def _computed(self, s: int, items: list[tuple[Seq, int, int, bool]], t1: float,
                  runs: list[tuple[str, int, int]]
                  ) -> tuple[list[tuple[str, float]], list[tuple[Any, float]]]:
        """What step ``s`` (ending at ``t1``) computed: decoders' tokens, prefill chunks,
        samples; returns its first tokens and the requests it ended."""
        book = self.book
        book.advance(self.n_dec)
        book.fill_decoders(s)
        finishing = self._finishing(s)
        first_tokens = []
        for seq, start, n, sample in items:
            end = start + n
            seq.computed = end
            book.commit(seq, start, end)
            self.sum_partial += n
            if sample:
                seq.out += 1
                if seq.out == 1:
                    first_tokens.append((seq.rid, t1))
                if seq.run_start is None:
                    seq.run_start = s
                if seq.out >= seq.target:
                    finishing.append(seq)
                else:
                    self._join(seq, s + 1)
        finished = [(f, t1) for f in self.rejected]
        self.rejected = []
        if finishing:
            self._retire(finishing, s + 1, t1, runs, finished)
        return first_tokens, finished

    def _runs_of(self, block: StepBlock) -> None:
        """The block's runs of token-emitting steps: those that ended in it and those going
        on, each from where the block starts (earlier steps were reported with theirs)."""
        first, end = block.first_step, block.first_step + block.steps
        # A run a preemption ends at the block's first step had all its steps before it.
        runs = [(rid, max(a, first), b) for rid, a, b in block.runs if b > first]
        runs += [(q.rid, max(q.run_start, first), end) for q in self.running
                 if q.run_start is not None and q.run_start < end]
        block.runs = runs

    def _retire(self, finishing: list[Seq], s: int, t1: float,
                runs: list[tuple[str, int, int]], finished: list[tuple[Finished, float]]) -> None:
        """Free the sequences that sampled their last token in the step before step ``s``
        (ending at ``t1``), in running order."""
        finishing.sort(key=_order)
        book = self.book
        for seq in finishing:
            committed = self._leave(seq, s)
            seq.running = False
            book.free(seq, True, committed, s)
            runs.append((seq.rid, seq.run_start, s))  # type: ignore[arg-type]
            finished.append((Finished(seq.rid, cached_tokens=seq.cached), t1))
        self.running = [q for q in self.running if q.running]

    def _schedule_running(self, s: int, items: list, preempted: list[Seq],
                          runs: list[tuple[str, int, int]]) -> int:
        """The scheduler's pass over the running sequences, one at a time, for a step in
        which some allocation may fail: a sequence that cannot grow preempts the most
        recently admitted ones until it can (or itself). Returns the token budget left."""
        book, running = self.book, self.running
        budget = self.token_budget
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.decoding:
                start, num_new = s + seq.c, 1
            else:
                start = seq.computed
                num_new = seq.num_tokens - start
            if num_new > budget:
                if not self.chunked:
                    i += 1
                    continue
                num_new = budget
            while not book.grow(seq, start, num_new):
                victim = running.pop()
                self._preempt(victim, s, runs)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                if not seq.decoding:
                    items.append((seq, start, num_new, start + num_new == seq.num_tokens))
                budget -= num_new
                i += 1
        return budget

    def _preempt(self, seq: Seq, s: int, runs: list[tuple[str, int, int]]) -> None:
        committed = self._leave(seq, s)
        seq.swapped = self.book.swap_out(seq, committed)
        self.book.free(seq, False, committed, s)
        if seq.run_start is not None:
            runs.append((seq.rid, seq.run_start, s))
            seq.run_start = None
        if not seq.swapped:
            seq.computed = seq.cached = 0
        seq.running = False
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self, s: int, budget: int, items: list, scheduled: list[str]
               ) -> tuple[int, int, int]:
        """Admit waiting sequences FCFS while they fit; the refusal of the one that did
        not (its footprint, the free bytes and largest free run then), or none."""
        waiting, book = self.waiting, self.book
        while waiting and budget > 0:
            seq = waiting[0]
            if len(self.running) + 1 > self.max_seqs:
                break
            cached, hits = book.lookup(seq)
            total = seq.num_tokens
            num_new = total - cached
            if num_new > budget:
                if not self.chunked:
                    break
                num_new = budget
            if not book.allocate(seq, cached, hits, num_new, s):
                free, largest = book.free_now()
                return book.footprint(seq.request).tokens * self.bpt, free, largest
            waiting.popleft()
            seq.running = True
            seq.order = self._order
            self._order += 1
            self.running.append(seq)
            seq.computed = cached
            if seq.swapped:  # back where it stopped: its cached tokens are its first run's
                seq.swapped = False
            else:
                seq.cached = cached
            self.sum_partial += cached
            if not seq.scheduled:
                seq.scheduled = True
                scheduled.append(seq.rid)
            items.append((seq, cached, num_new, cached + num_new == total))
            budget -= num_new
        return _NO_REFUSAL

    # --- decoders --------------------------------------------------------------------------

    def _join(self, seq: Seq, s: int) -> None:
        """``seq`` decodes from step ``s`` on."""
        c = seq.computed - s
        seq.c, seq.decoding = c, True
        seq.fin = seq.target + seq.num_prompt - c - 2
        self.n_dec += 1
        self.sum_c += c
        self.sum_partial -= seq.computed
        heapq.heappush(self._finishes, (seq.fin, seq.order, seq))
        self.book.join(seq)

    def _leave(self, seq: Seq, s: int) -> int:
        """Take ``seq`` out of the running sums as of (the start of) step ``s``; returns its
        computed tokens then."""
        if not seq.decoding:
            self.sum_partial -= seq.computed
            return seq.computed
        computed = s + seq.c
        seq.computed = computed
        seq.out = computed + 1 - seq.num_prompt
        seq.decoding = False
        self.n_dec -= 1
        self.sum_c -= seq.c
        self.book.leave(seq)
        return computed

    def _next_finish(self) -> int:
        heap = self._finishes
        while heap and not _current(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf  # type: ignore[return-value]

    def _finishing(self, s: int) -> list[Seq]:
        """The decoders that sample their last token at step ``s``."""
        out = []
        heap = self._finishes
        while heap and heap[0][0] <= s:
            entry = heapq.heappop(heap)
            if _current(entry):
                out.append(entry[2])
        return out

    # --- device memory and reports -----------------------------------------------------

    def _text_bytes(self, s: int, used: int) -> int | None:
        """Used KV bytes of the text tokens the running sequences hold after step ``s - 1``
        (prompts are text here), or None where they do not account for the used bytes."""
        held = self.n_dec * s + self.sum_c + self.sum_partial - self.book.shared_tokens()
        return held * self.bpt if held * self.bpt == used else None

    def _last_kv(self, mark: tuple[Any, ...] | None = None) -> KVStats:
        """The KV snapshot after the last step: the book's now (as that step left it), or
        as ``mark`` found it before a step that failed."""
        refusal, encoder, text = self._last
        kv = self.book.stats(mark)
        kv.refused_bytes, kv.refused_free_bytes, kv.refused_largest_free_bytes = refusal
        kv.encoder_cache_bytes = encoder
        if text is not None:
            kv.modalities = self.modalities.figures((text // self.bpt, 0, 0), kv)
        return kv

    # --- quiet stretches -------------------------------------------------------------------

    def _quiet(self, block: StepBlock, t: float, due_s: float, held: bool) -> float | None:
        """Take the next steps in one go while nothing happens in them but decoding: every
        running sequence decodes one token, no allocation can fail and nobody waiting can be
        admitted. Sequences may finish along the way where nothing waits for what they free
        (no request waiting, none held back by the concurrency limit). Returns the clock
        time after them (None when the next step has other events)."""
        running, book = self.running, self.book
        n = self.n_dec
        if self.rejected or not n or n != len(running) or book.copies_pending():
            return None
        s = self.step
        need = avoid = None
        if self.waiting:
            head = self.waiting[0]
            budget = self.token_budget - n
            if n + 1 <= self.max_seqs:
                cached, hits = book.lookup(head)
                num_new = head.num_tokens - cached
                blocked = False
                if num_new > budget:
                    if self.chunked:
                        num_new = budget
                    else:
                        blocked = True
                if not blocked:
                    if book.would_admit(head, cached, hits, num_new) is not False:
                        return None
                    need = book.footprint(head.request).tokens * self.bpt
                    avoid = book.waiting_hashes(head)
        absorb = (not self.waiting and not held and self.window is None
                  and self.acts.attention == "fused")
        plan = self._plan_finishes(s, self._reach(t, due_s)) if absorb else []
        # Up to the first finish not planned, or the last planned when it ends them all.
        horizon = min(MAX_DECODE_RUN, self._next_finish() - s)
        if plan and sum(len(q) for _, q in plan) == n:
            horizon = plan[-1][0] + 1
        if horizon < 1:
            return None
        steps = self._stretch_steps(s, horizon, n, plan, need is not None, t, due_s)
        if steps is None:
            self._unplan(plan, s)
            return None
        k, ends, nums = steps
        self._pace = float(ends[1] - ends[0])
        if avoid:
            k = book.fill_stop(s, k, avoid)
            if not k:
                return None
        # Device memory, segment by segment (between finishes).
        memory = self.memory
        memory.begin_decode()
        longest = 0 if self.acts.attention == "fused" else s + 1 + max(q.c for q in running)
        segments = _segments(plan, k)
        devices = []
        for a, b in segments:
            got, device, reserved = memory.decode_steps(int(nums[a]), longest, b - a + 1)
            if got < b - a + 1:
                k = a + got
                break
            memory.end_decode(reserved)
            devices.append(device)
        if not k:
            self._unplan(plan, s)
            return None
        fin = {f: q for f, q in plan if f < k}
        for (a, b), device in zip(segments, devices, strict=False):
            if a >= k:
                break
            b = min(b, k - 1)
            t = self._segment(block, s, a, b, ends, int(nums[a]), need, device, fin.pop(b, None))
            if book.copies_pending():
                # A compaction after a release queued copies: the next step makes them.
                k = b + 1
                break
        self._unplan([(f, q) for f, q in plan if f >= k or f in fin], s)
        self.step = s + k
        block.device_ranks = memory.tp
        return t

    def _stretch_steps(self, s: int, horizon: int, n: int, plan: list[tuple[int, list[Seq]]],
                       keep_cached: bool, t: float, due_s: float
                       ) -> tuple[int, np.ndarray, np.ndarray] | None:
        """How many of the next ``horizon`` steps can run as decode steps (their blocks
        there, none past the first ending at or after ``due_s``), their end times from
        ``t`` and their decoders; None when not one."""
        book = self.book
        j = np.arange(horizon, dtype=np.int64)
        if plan:
            at = np.asarray([f for f, _ in plan], dtype=np.int64)
            # Plan entries before each step: those sequences have left by then.
            before = at.searchsorted(j, side="left")
            m = len(plan) + 1
            nums = n - np.fromiter(accumulate((len(q) for _, q in plan), initial=0),
                                   np.int64, m)[before]
            sum_c = self.sum_c - np.fromiter(
                accumulate((sum(x.c for x in q) for _, q in plan), initial=0), np.int64, m
            )[before]
        else:
            before = None
            nums = np.full(horizon, n, dtype=np.int64)
            sum_c = self.sum_c
        room = book.room(s, horizon, keep_cached, plan, before)
        if room < 1:
            return None
        if room < horizon:
            j, nums = j[:room], nums[:room]
            if plan:
                sum_c = sum_c[:room]
        if self.window is None:
            context = nums * (s + 1 + j) + sum_c
        else:
            c = np.fromiter((q.c for q in self.running), np.int64, n)
            context = np.minimum(s + 1 + c[None, :] + j[:, None], self.window).sum(axis=1)
        dts = self.cost.decode_step_times(nums if plan else n, context, context)
        if dts is None:
            return None
        ends = np.concatenate(([t], dts)).cumsum()
        k = len(j)
        if due_s != math.inf:
            k = min(k, int(ends[1:].searchsorted(due_s, side="left")) + 1)
        return k, ends, nums

    def _segment(self, block: StepBlock, s: int, a: int, b: int, ends: np.ndarray, n: int,
                 need: int | None, device: dict[str, Any], finishing: list[Seq] | None
                 ) -> float:
        """Apply steps ``s + a .. s + b`` of a stretch, ``n`` decoders each; the last one
        finishes ``finishing``. Returns the clock time after them."""
        book = self.book
        before = book.values()
        # Text KV held before the segment (prompts are text here): where it accounts for
        # the used KV, both grow alike along it.
        text = (n * (s + a) + self.sum_c - book.shared_tokens()) * self.bpt
        known = text == before[2]
        held = book.held()
        taken, limits, held_steps = book.quiet(s + a, b - a + 1, n)
        refusal = _NO_REFUSAL if need is None else (need, before[4], before[5])
        first, last, varying = [], [], {}
        for name, col in device.items():
            if isinstance(col, np.ndarray):
                varying[INDEX[f"device:{name}"]] = col
                first.append(int(col[0]))
                last.append(int(col[-1]))
            else:
                first.append(col)
                last.append(col)
        k = b - a + 1 - (finishing is not None)
        if k:
            block.stretch((
                0.0, 0.0, n, n, len(self.waiting), 0, *before, *refusal, first[_ENCODER],
                text if known else None, *((0, 0) if known else (None, None)), *first,
            ), ends[a + 1 : a + k + 1], n, known, need is not None,
                None if taken is None else taken[:k], None if limits is None else limits[:k],
                {i: col[:k] for i, col in varying.items()}, held,
                None if held_steps is None else held_steps[:, :k])
        t1 = float(ends[b + 1])
        if finishing is None:
            after = book.values()
            self._last = (_NO_REFUSAL if need is None else (need, after[4], after[5]),
                          last[_ENCODER], text + n * k * self.bpt if known else None)
            return t1
        # The last step: its decoders' tokens, then the finished sequences leave.
        runs: list[tuple[str, int, int]] = []
        finished: list[tuple[Finished, float]] = []
        self._retire(finishing, s + b + 1, t1, runs, finished)
        values = book.values()
        text = self._text_bytes(s + b + 1, values[2])
        block.row((
            t1, t1 - float(ends[b]), n, len(self.running), len(self.waiting), 0, *values,
            *_NO_REFUSAL, last[_ENCODER], text, *((0, 0) if text is not None else (None, None)),
            *last,
        ), book.held())
        block.runs += runs
        block.finished += finished
        block.ended.append((s + b, len(finished)))
        self._last = (_NO_REFUSAL, last[_ENCODER], text)
        self.idle = 0
        return t1

    def _reach(self, t: float, due_s: float) -> int:
        """About how many steps from ``t`` the next arrival (at ``due_s``) is, at the pace of
        the last step, with a margin: finishes beyond are not worth planning (a stretch
        that falls short is followed by another)."""
        if due_s == math.inf or self._pace <= 0:
            return MAX_DECODE_RUN
        return min(MAX_DECODE_RUN, int((due_s - t) / self._pace * 1.25) + 8)

    def _plan_finishes(self, s: int, reach: int) -> list[tuple[int, list[Seq]]]:
        """Take from the finish queue the decoders that finish within the next ``reach``
        steps: (step after ``s``, sequences), in step order."""
        heap, plan = self._finishes, []
        end = s + reach
        while heap and heap[0][0] < end:
            entry = heapq.heappop(heap)
            if not _current(entry):
                continue
            f = entry[0] - s
            if plan and plan[-1][0] == f:
                plan[-1][1].append(entry[2])
            else:
                plan.append((f, [entry[2]]))
        return plan

    def _unplan(self, plan: list[tuple[int, list[Seq]]], s: int) -> None:
        """Put planned finishes not taken back into the finish queue."""
        for f, seqs in plan:
            for seq in seqs:
                heapq.heappush(self._finishes, (s + f, seq.order, seq))


def _segments(plan: list[tuple[int, list[Seq]]], k: int) -> list[tuple[int, int]]:
    """Steps ``0 .. k - 1`` of a stretch cut after each planned finish: (first, last)."""
    out, a = [], 0
    for f, _ in plan:
        if f >= k:
            break
        out.append((a, f))
        a = f + 1
    if a < k:
        out.append((a, k - 1))
    return out


# The encoder's place among the device memory components.
_ENCODER = DeviceMemory.COMPONENTS.index("encoder")


def _current(entry: tuple[int, int, Seq]) -> bool:
    """Whether a finish entry is still its sequence's (not one from before a preemption)."""
    fin, order, seq = entry
    return seq.decoding and seq.fin == fin and seq.order == order


def _order(seq: Seq) -> int:
    return seq.order


def _steady(value: int, steps: int) -> np.ndarray:
    return np.full(steps, value, dtype=np.int64)
