"""Continuous-batching scheduler shared by every built-in engine.

One rule covers prefill, chunked prefill, decode and recompute (as in vLLM v1): a step
computes KV for positions ``[num_computed_tokens, num_tokens)`` of each scheduled sequence,
possibly a chunk of them, and samples a token once a sequence is fully computed. Running
sequences go first, in admission order; then waiting ones are admitted FCFS while
``max_num_seqs``, the token budget and the KV manager allow. When a running sequence cannot
grow, the most recently admitted one is preempted: its KV is freed and recomputed later, or
swapped out and back where the KV manager does that. A
manager that reserves everything at admission (contiguous) never needs to preempt: its
requests wait for an extent instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from kvbench.engines.builtin.executor import ScheduledBatch, ScheduledSeq
from kvbench.engines.kv.base import KVManager
from kvbench.engines.kv.spec import never_runs
from kvbench.engines.sequence import SeqStatus, Sequence
from kvbench.errors import KvbenchError
from kvbench.workloads.model import Request

# vLLM v1's defaults, used wherever a run leaves these unset.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    chunked_prefill: bool = True

    def validate(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise KvbenchError(
                "max_num_seqs and max_num_batched_tokens must be >= 1 and max_model_len >= 2"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise KvbenchError(
                f"without chunked prefill a whole prompt must fit in one step: raise "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) to at least "
                f"max_model_len ({self.max_model_len}), or enable chunked prefill"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _RequestState:
    request: Request
    samples: list[Sequence] = field(default_factory=list)
    running: int = 0
    finished: int = 0
    forked: bool = False


@dataclass(frozen=True, slots=True)
class Refusal:
    """The KV manager refused to admit the request at the head of the waiting queue: it
    needed ``need_bytes`` (its footprint) while ``free_bytes`` were free, the largest hole
    or page run ``largest_free_bytes``. Zeros: no request was refused."""

    need_bytes: int = 0
    free_bytes: int | None = 0
    largest_free_bytes: int | None = 0


NO_REFUSAL = Refusal()


@dataclass(slots=True)
class StepOutcome:
    """Bookkeeping results of one step, by request id."""

    tokens: dict[str, int] = field(default_factory=dict)
    first_token: set[str] = field(default_factory=set)
    finished: list[_RequestState] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        config.validate()
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._requests: dict[str, _RequestState] = {}
        self._next_seq_id = 0
        self.num_running_requests = 0
        # The last schedule()'s admission refusal (requests wait FCFS: at most one a step).
        self.refusal = NO_REFUSAL

    def rejection(self, request: Request) -> str | None:
        """Why ``request`` can never run here, or None."""
        kv = self.kv
        return never_runs(request, self.config.max_model_len, kv.footprint(request),
                          kv.bytes_per_token, self.config.max_num_seqs)

    def add(self, request: Request, prompt_ids: Any) -> None:
        seq = self._new_seq(request, prompt_ids, 0)
        self._requests[request.id] = _RequestState(request, [seq])
        self.waiting.append(seq)
        self.kv.arrive(seq)

    def _new_seq(self, request: Request, prompt_ids: Any, sample_index: int) -> Sequence:
        seq = Sequence(self._next_seq_id, request, prompt_ids, sample_index=sample_index)
        self._next_seq_id += 1
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit_computed(
        self, request: Request, prompt_ids: Any, output_ids: list[int], computed: int
    ) -> bool:
        """Admit ``request`` with the KV of its first ``computed`` tokens already present
        (received from a prefill replica) and ``output_ids`` already sampled: room for that
        KV is allocated now and the sequence runs from there. False, changing nothing, when
        it does not fit now or ``max_num_seqs`` sequences run."""
        if len(self.running) + 1 > self.config.max_num_seqs:
            return False
        seq = Sequence(self._next_seq_id, request, prompt_ids)
        seq.output_ids = list(output_ids)
        if not self.kv.allocate(seq, 0, computed):
            return False
        self._next_seq_id += 1
        seq.num_computed_tokens = computed
        self.kv.commit(seq)
        seq.status = SeqStatus.RUNNING
        seq.ever_scheduled = True
        self._requests[request.id] = _RequestState(request, [seq], running=1)
        self.running.append(seq)
        self.num_running_requests += 1
        return True

    def schedule(self) -> tuple[ScheduledBatch, list[Sequence], set[str]]:
        """Pick this step's work. Returns the batch, the sequences preempted and the request
        ids scheduled for the first time."""
        budget = self.config.max_num_batched_tokens
        chunked = self.config.chunked_prefill
        items: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        first: set[str] = set()
        kv = self.kv
        self.refusal = NO_REFUSAL

        running, grow = self.running, kv.grow
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start = seq.num_computed_tokens
            total = seq.num_prompt_tokens + len(seq.output_ids)
            num_new = total - start
            if num_new > budget:
                if not chunked:
                    i += 1
                    continue
                num_new = budget
            while not grow(seq, num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                items.append(ScheduledSeq(seq, start, num_new, start + num_new == total))
                budget -= num_new
                i += 1

        # Admitting while preempting would thrash: the freed memory goes to the preempted.
        if not preempted:
            max_seqs = self.config.max_num_seqs
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                n_samples = seq.request.n if not self._requests[seq.request.id].forked else 1
                if len(self.running) + n_samples > max_seqs:
                    break
                cached = kv.lookup_prefix(seq)
                num_new = seq.num_tokens - cached
                if num_new > budget:
                    if not chunked:
                        break
                    num_new = budget
                if not kv.allocate(seq, cached, num_new):
                    self.refusal = self._refusal(seq)
                    break
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                state = self._requests[seq.request.id]
                if state.running == 0:
                    self.num_running_requests += 1
                state.running += 1
                if not seq.ever_scheduled:
                    seq.ever_scheduled = True
                    if seq.sample_index == 0:
                        first.add(seq.request.id)
                start = seq.num_computed_tokens
                items.append(ScheduledSeq(seq, start, num_new, start + num_new == seq.num_tokens))
                budget -= num_new

        kv.background()
        batch = ScheduledBatch(items, kv.take_copies(), kv.take_map_ops(), kv.take_load_s(),
                               kv.load_layerwise)
        return batch, preempted, first

    def decode_only(self) -> tuple[list[Sequence], int | None, set[int] | None] | None:
        """Whether the next steps are all alike until some event: every running sequence
        decodes one token (all fit the token budget) and the request at the head of the
        waiting queue, if any, stays unadmitted for a reason decoding cannot change (the
        sequence limit, the budget, or a KV refusal while memory only shrinks). Returns the
        running sequences, the footprint in bytes the KV manager refuses each step (None:
        no refusal) and the prefix-cache keys whose appearance could let the head in; None
        when the next step must run on its own."""
        running, config = self.running, self.config
        n = len(running)
        if not n or n > config.max_num_batched_tokens:
            return None
        for seq in running:
            if not seq.output_ids or seq.num_computed_tokens != seq.num_tokens - 1:
                return None
        if not self.waiting:
            return running, None, None
        budget = config.max_num_batched_tokens - n
        if budget <= 0:
            return running, None, None
        seq, kv = self.waiting[0], self.kv
        n_samples = seq.request.n if not self._requests[seq.request.id].forked else 1
        if n + n_samples > config.max_num_seqs:
            return running, None, None
        cached = kv.lookup_prefix(seq)
        num_new = seq.num_tokens - cached
        if num_new > budget:
            if not config.chunked_prefill:
                return running, None, None
            num_new = budget
        if kv.would_admit(seq, cached, num_new) is not False:
            return None
        need = kv.footprint(seq.request).tokens * kv.bytes_per_token
        return running, need, kv.waiting_hashes(seq)

    def advance_decode(self, seqs: list[Sequence], steps: int) -> None:
        """Account ``steps`` decode steps of ``seqs`` (their tokens already appended)."""
        for seq in seqs:
            seq.num_computed_tokens += steps

    def _refusal(self, seq: Sequence) -> Refusal:
        # Free memory as the refusal saw it: the step's end frees finished requests' KV.
        kv = self.kv
        snapshot = kv.stats()
        return Refusal(kv.footprint(seq.request).tokens * kv.bytes_per_token,
                       snapshot.free_bytes, snapshot.largest_free_bytes)

    def _preempt(self, seq: Sequence) -> None:
        if not self.kv.swap_out(seq):
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.num_cached_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        state = self._requests[seq.request.id]
        state.running -= 1
        if state.running == 0:
            self.num_running_requests -= 1
        self.waiting.appendleft(seq)

    def update(self, batch: ScheduledBatch, sampled: list[int]) -> StepOutcome:
        """Advance sequences after the executor ran ``batch``; ``sampled`` holds one token per
        sampling item, in order."""
        out = StepOutcome()
        commit = self.kv.commit
        tokens = out.tokens
        it = iter(sampled)
        done = False
        for item in batch.items:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            commit(seq)
            if not item.sample:
                continue
            output = seq.output_ids
            output.append(next(it))
            request = seq.request
            rid = request.id
            tokens[rid] = tokens.get(rid, 0) + 1
            # Only sample 0 ever holds a single output token (forks copy the parent's): this
            # is the request's first token.
            if len(output) == 1:
                out.first_token.add(rid)
            if request.n > 1:
                state = self._requests[rid]
                if not state.forked:
                    self._fork(state, seq, tokens)
            if len(output) >= request.output_tokens:
                done = True
        if done:
            self._retire(out)
        return out

    def _fork(self, state: _RequestState, parent: Sequence, tokens: dict[str, int]) -> None:
        """Start the other samples from the parent's KV once its prefill produced a token."""
        state.forked = True
        for k in range(1, parent.request.n):
            child = self._new_seq(parent.request, parent.prompt_ids, k)
            child.output_ids = list(parent.output_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SeqStatus.RUNNING
            child.ever_scheduled = True
            self.kv.fork(parent, child)
            state.samples.append(child)
            state.running += 1
            self.running.append(child)
            tokens[parent.request.id] += 1

    def _retire(self, out: StepOutcome) -> None:
        keep: list[Sequence] = []
        for seq in self.running:
            if not seq.is_finished:
                keep.append(seq)
                continue
            self.kv.free(seq)
            seq.status = SeqStatus.FINISHED
            state = self._requests[seq.request.id]
            state.running -= 1
            state.finished += 1
            if state.running == 0:
                self.num_running_requests -= 1
            if state.finished == seq.request.n:
                out.finished.append(state)
                del self._requests[seq.request.id]
        self.running = keep
