"""The KV manager interface every KV policy implements.

Managers only do bookkeeping: which physical token slots hold which sequence's KV. The
physical pool is a flat array of ``capacity_tokens`` slots (paged: ``num_blocks x
block_size``, slot = block * block_size + offset; contiguous: a linear arena). An executor
backs the slots with real tensors, reading only this interface: the pool's size and
:class:`KVSpec`, each token's slot, and the attention layout of a batch. The sim executor
backs the slots with nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvbench.engines.base import KVStats
from kvbench.engines.kv.oracle import PrefixOracle
from kvbench.engines.kv.spec import Footprint, KVSpec, LayerPools, never_runs
from kvbench.engines.sequence import Sequence
from kvbench.kernels.layouts import KVLayout
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.workloads.model import Request


def newly_computed(seq: Sequence, committed: int, room: int, what: str) -> int:
    """Tokens ``seq`` computed since its last commit (``committed`` of them then), checked to
    lie within the ``room`` slots of its ``what``: outside them is a bookkeeping bug."""
    n = seq.num_computed_tokens
    if not committed <= n <= room:
        raise RuntimeError(
            f"sequence {seq.seq_id}: {n} computed tokens outside its {what} "
            f"(committed {committed}, room {room})"
        )
    return n - committed


class KVManager(ABC):
    spec: KVSpec
    capacity_tokens: int
    max_model_len: int
    # False for a policy that keeps finished sequences' pages (a fault under test): an
    # executor backing sequences with their own memory keeps theirs too.
    releases_finished: bool = True

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token

    @abstractmethod
    def footprint(self, request: Request) -> Footprint:
        """Slots ``request`` needs in an empty cache before it can run at all."""

    @abstractmethod
    def held_tokens(self, prompt: int, output: int, n: int = 1) -> int:
        """Slots a request of ``prompt`` + ``output`` tokens and ``n`` samples holds at its
        longest (capacity planning)."""

    def never_fits(self, request: Request) -> str | None:
        """Why ``request`` could never be admitted even into an empty cache, or None."""
        return never_runs(request, self.max_model_len, self.footprint(request),
                          self.bytes_per_token)

    @abstractmethod
    def lookup_prefix(self, seq: Sequence) -> int:
        """Prompt tokens already cached for ``seq`` (prefix caching); no side effects."""

    def cached_prefix_tokens(self, prompt_ids: np.ndarray) -> int:
        """Leading tokens of a prompt whose KV this cache holds now (a router's view of a
        replica's prefix cache); no side effects. 0 for a policy without prefix caching."""
        return 0

    @abstractmethod
    def allocate(self, seq: Sequence, num_cached: int, num_new: int) -> bool:
        """Admit ``seq``: attach ``num_cached`` cached tokens and room for ``num_new`` more.

        Returns False, changing nothing, when it does not fit now. On success sets
        ``seq.num_computed_tokens = seq.num_cached_tokens = num_cached``.
        """

    @abstractmethod
    def grow(self, seq: Sequence, num_new: int) -> bool:
        """Make room for ``num_new`` tokens after ``seq.num_computed_tokens``; False if none."""

    @abstractmethod
    def commit(self, seq: Sequence) -> None:
        """Called after a step computed KV up to ``seq.num_computed_tokens`` (caches blocks)."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release everything ``seq`` holds (finish or preemption)."""

    def swap_out(self, seq: Sequence) -> bool:
        """Preempt ``seq`` by moving its KV out of device memory (freeing it there) so that
        it resumes without recomputing; False, changing nothing, where it is freed and
        recomputed instead. A swapped sequence's :meth:`lookup_prefix` is its computed
        tokens and :meth:`allocate` brings them back."""
        return False

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the same KV as ``parent`` (parallel samples)."""

    @abstractmethod
    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Physical slots of token positions ``[start, end)`` of ``seq`` (int64)."""

    @abstractmethod
    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> KVLayout:
        """Where each of ``seqs`` (with ``context_lens`` KV positions each) finds its KV."""

    @abstractmethod
    def take_copies(self) -> list[SlotCopy]:
        """Copies queued since the last call, in order."""

    def arrive(self, seq: Sequence) -> None:  # noqa: B027 (an optional hook)
        """``seq``, the first sample of a request, has just arrived (a policy that reserves
        memory ahead of admission does it here)."""

    def works_between_steps(self) -> bool:
        """Whether :meth:`background` may change anything: a jump would skip it."""
        return type(self).background is not KVManager.background

    def background(self) -> None:  # noqa: B027 (an optional hook)
        """Work that overlaps the step whose batch was just chosen (pre-mapping pages,
        pre-splitting them): it costs the step no time."""

    def trace_prefix_accesses(self, on: bool) -> None:  # noqa: B027 (an optional hook)
        """Whether to record prefix-cache accesses for :meth:`prefix_oracle` (from now on)."""

    def prefix_oracle(self) -> PrefixOracle | None:
        """MIN's hits on this manager's prefix-cache accesses so far
        (:mod:`~kvbench.engines.kv.oracle`); None for a policy that records none."""
        return None

    def layer_pools(self) -> LayerPools | None:
        """Where each layer finds its KV when layer groups are allocated apart, or None: every
        layer at the same slots of one pool."""
        return None

    def pool_classes(self) -> tuple[Any, ...] | None:
        """The page classes of a pool that stores modalities apart (each its own slots and
        dtype: :class:`~kvbench.engines.kv.page_classes.PoolClass`), or None for one flat pool."""
        return None

    # Whether loads from offload tiers overlap compute layer by layer (else a step waits).
    load_layerwise = False

    def take_load_s(self) -> float:
        """Seconds of KV loads from offload tiers since the last call, which the next step
        waits for; 0 for policies without tiers."""
        return 0.0

    def take_map_ops(self) -> int:
        """Virtual-memory map and unmap operations done on the critical path since the last
        call (the step waits for them); 0 for policies that map nothing."""
        return 0

    # --- decode fast-forward (optional) ---------------------------------------------------
    #
    # Between events, every step of a batch whose sequences all decode one token is alike:
    # the engine can advance many such steps at once when the manager says how far that is
    # safe and applies them exactly as one step after another would. A policy opts in by
    # defining decode_room and advance_decode; a subclass inherits them unless it changes
    # one of the per-step hooks they stand in for (:data:`STEP_HOOKS`).

    def fast_forward_blocker(self) -> str | None:
        """Why this manager cannot advance decode steps in bulk, or None when it can."""
        cls = type(self)
        name = cls.__name__
        if self.works_between_steps():
            return f"the {name} policy works between steps"
        owner = defining_class(cls, "decode_room")
        if owner is KVManager:
            return f"the {name} policy advances step by step (it defines no decode_room)"
        changed = overrides(cls, owner, STEP_HOOKS)
        if changed:
            return (f"the {name} policy advances step by step: it overrides "
                    f"{', '.join(changed)} of {owner.__name__} but not its decode_room")
        return None

    def decode_room(self, seqs: list[Sequence], max_steps: int, keep_cached: bool = False) -> int:
        """How many consecutive steps, up to ``max_steps``, in which each of ``seqs`` (the
        running sequences, in order, each one token short of its computed tokens) decodes
        one token, this manager can take with nothing but the bookkeeping of those tokens:
        no allocation that could fail, no copy, no page released or moved; with
        ``keep_cached``, no cached prefix evicted either."""
        return 0

    def decode_stop(self, seqs: list[Sequence], steps: int, avoid: set[int]) -> int:
        """The first of the next ``steps`` decode steps of ``seqs`` (their ``output_ids``
        already hold the tokens those steps sample) that would make a block findable whose
        prefix-cache key is in ``avoid`` (one the request waiting at the head of the queue
        could hit), or ``steps`` when none would."""
        return steps

    def advance_decode(self, seqs: list[Sequence], steps: int) -> dict[str, np.ndarray]:
        """Apply ``steps`` (at most :meth:`decode_room`) decode steps of ``seqs``, whose
        ``output_ids`` already hold the tokens those steps sample and whose
        ``num_computed_tokens`` the caller advances afterwards, exactly as that many
        grow/commit rounds would. Returns the per-step values, after each step, of the
        :class:`KVStats` fields that change, keyed by field. Only policies that define their
        :meth:`decode_room` fast-forward; the engine calls this for no other."""
        raise NotImplementedError(
            f"{type(self).__name__} does not fast-forward decode steps (it defines no "
            "decode_room): run it step by step"
        )

    def would_admit(self, seq: Sequence, num_cached: int, num_new: int) -> bool | None:
        """Whether :meth:`allocate` would admit ``seq`` now, without changing anything;
        None where the policy cannot tell."""
        return None

    def waiting_hashes(self, seq: Sequence) -> set[int] | None:
        """Prefix-cache keys whose appearance could let ``seq`` hit more cached KV (None:
        the policy has no prefix cache)."""
        return None

    @abstractmethod
    def stats(self) -> KVStats:
        """Current memory snapshot."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Configuration as JSON-able data."""


# What a decode jump does in place of one step after another: a subclass that overrides one
# of these would be jumped past wrongly unless it also redefines the jump.
STEP_HOOKS = ("grow", "commit", "take_copies", "take_map_ops", "take_load_s", "stats",
              "background")


def defining_class(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO that defines attribute ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))


def overrides(cls: type, base: type, names: Iterable[str]) -> list[str]:
    """Which of ``names`` ``cls`` (a subclass of ``base``) defines anew below ``base``."""
    return [n for n in names if defining_class(cls, n) not in base.__mro__]


def written_columns(num_seqs: int, steps: int, bytes_per_token: int, used: int,
                    committed: int, limit: int) -> dict[str, np.ndarray]:
    """The used and reserved-ahead bytes after each of ``steps`` decode steps in which
    ``num_seqs`` sequences each write one slot of their own, from ``used`` slots written and
    ``committed`` of the ``limit`` slots their holders will have written."""
    step = num_seqs * np.arange(1, steps + 1, dtype=np.int64)
    return {"used_bytes": (used + step) * bytes_per_token,
            "reserved_ahead_bytes": (limit - (committed + step)) * bytes_per_token}


def steps_to_end(seqs: list[Sequence], max_steps: int,
                 held: Callable[[Sequence], tuple[int, int]]) -> int:
    """Decode steps, up to ``max_steps``, before one of ``seqs`` writes past the slots it
    holds, where ``held(seq)`` is (tokens committed, slots held); 0 when one has computed
    tokens it has not committed."""
    room = max_steps
    for seq in seqs:
        committed, slots = held(seq)
        if committed != seq.num_computed_tokens:
            return 0
        room = min(room, slots - committed)
    return max(room, 0)


def steps_within(first: list[int], block_size: int, max_steps: int, free: int) -> int:
    """How many decode steps, up to ``max_steps``, sequences that reach a block boundary
    ``first[i]`` steps from now (and every ``block_size`` steps after) can take while the
    blocks they take between them number at most ``free``."""
    start = np.asarray(first, dtype=np.int64)

    def taken(j: int) -> int:
        """Blocks the grows of steps 0 .. j take together."""
        return int(np.maximum(0, (j - start) // block_size + 1).sum())

    if taken(max_steps - 1) <= free:
        return max_steps
    lo, hi = 0, max_steps - 1  # taken(hi) > free; find the first such step
    while lo < hi:
        mid = (lo + hi) // 2
        if taken(mid) > free:
            hi = mid
        else:
            lo = mid + 1
    return lo
