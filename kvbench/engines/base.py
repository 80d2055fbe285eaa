"""The Engine protocol every engine implements, and what a step reports.

Fields an engine cannot observe are ``None`` (absent), never zero.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from kvbench.workloads.model import Request

if TYPE_CHECKING:
    from kvbench.engines.kv.oracle import PrefixOracle
    from kvbench.engines.sim.costmodel import CostModel

# The most decode steps one jump takes (bounds its per-step arrays).
MAX_DECODE_RUN = 4096


def output_digest(samples: Sequence[Sequence[int]]) -> str:
    """Digest of a request's generated token ids, samples in order, so that any two runs
    (any engines) can be compared request by request."""
    return "+".join(
        hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:16] for ids in samples
    )


@dataclass(slots=True)
class KVStats:
    """A snapshot of KV-cache memory. Counters (``prefix_*``, ``block_*``, ``evictions``,
    ``copied_bytes`` and the policy counters below) are cumulative; the rest are gauges.
    ``capacity_bytes`` is None only where a served engine does not publish its pool size."""

    capacity_bytes: int | None
    used_bytes: int | None = None
    reserved_bytes: int | None = None
    # Of reserved_bytes, the slots live sequences will still write (their remaining prompt
    # and output tokens, up to their reservation): splits waste into reservation vs internal.
    reserved_ahead_bytes: int | None = None
    free_bytes: int | None = None
    largest_free_bytes: int | None = None
    shared_bytes: int | None = None
    prefix_hit_tokens: int | None = None
    prefix_query_tokens: int | None = None
    block_allocs: int | None = None
    block_frees: int | None = None
    # Bytes of KV copied between slots (copy-on-write, compaction, migration).
    copied_bytes: int | None = None
    # Entries of the address-translation structures live sequences hold (block-table
    # entries, extent descriptors, mapped pages): what the layout costs to look up.
    page_table_entries: int | None = None
    # Cached prefix blocks evicted to make room.
    evictions: int | None = None
    # Page merges and splits, and bytes moved to make pages mergeable (mixed page sizes).
    merges: int | None = None
    splits: int | None = None
    migrated_bytes: int | None = None
    # Virtual-memory mapping operations (virtually contiguous KV).
    map_ops: int | None = None
    unmap_ops: int | None = None
    # This step's admission: the bytes the request at the head of the waiting queue needed
    # (its footprint) when the KV manager refused it, 0 when none was refused, and the free
    # and largest free bytes at that moment (0 when none was). A refusal while enough memory
    # was free in total is external fragmentation: no hole, page run or size class fit.
    refused_bytes: int | None = None
    refused_free_bytes: int | None = None
    refused_largest_free_bytes: int | None = None
    # Per page class of a modality-aware pool (its dtype, page size, capacity, reserved and
    # used bytes); None for a single-class pool.
    classes: dict[str, dict[str, Any]] | None = None
    # Bytes of encoder outputs (image / audio embeddings) kept for reuse, beside the KV.
    encoder_cache_bytes: int | None = None
    # Per modality of the tokens held (text, image, audio): its page class, dtype, bytes per
    # element and per token, tokens held and used bytes (kvbench.engines.kv.modality); None
    # where the engine cannot attribute its used KV to modalities.
    modalities: dict[str, dict[str, Any]] | None = None
    # KV kept below device memory (host memory, disk or a store: an offloading connector,
    # LMCache, SGLang's HiCache). Counters: prompt tokens served from there, bytes moved to
    # and from it and the seconds those moves took; a gauge: the bytes it holds.
    offload_hit_tokens: int | None = None
    offload_stored_bytes: int | None = None
    offload_loaded_bytes: int | None = None
    offload_store_s: float | None = None
    offload_load_s: float | None = None
    offload_used_bytes: int | None = None
    # Of the bytes moved: preempted sequences' KV swapped out and back (swap preemption).
    offload_swapped_out_bytes: int | None = None
    offload_swapped_in_bytes: int | None = None
    # Per tier of the built-in engine's offload (kvbench.engines.kv.offload): capacity and
    # used bytes, blocks hit and dropped, bytes moved each way and the seconds they took.
    offload_tiers: dict[str, dict[str, Any]] | None = None
    # Per allocation group of a model whose layers keep different kinds of KV
    # (kvbench.engines.kv.hybrid): its kind, layers, block bytes, reserved and used bytes,
    # and the prefix-hit tokens it alone could have served.
    groups: dict[str, dict[str, Any]] | None = None


@dataclass(slots=True)
class DeviceMemory:
    """Device memory at a step's peak, as an engine that models it (the simulator) reports
    it, summed over the ``tp`` tensor-parallel ranks (each holds ``1/tp`` of every figure).

    Live tensors (``allocated_bytes``): the weights, the KV cache, the activations of the
    linear layers, the attention kernel's workspace and masks, and encoder outputs (with the
    encoder's own activations in ``activation_bytes``). The caching allocator also holds
    memory that no tensor does (freed blocks it keeps, rounding, split remainders): around
    the KV cache's tensors (``kv_cached_bytes``, its fragmentation) and around the step
    workspace (``workspace_cached_bytes``, activations freed after an earlier, larger step);
    with them, ``reserved_bytes``. ``non_torch_bytes`` (CUDA context, library handles) is
    device memory outside the allocator: with it, ``used_bytes``, what ``nvidia-smi`` shows.
    """

    tp: int
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    attention_bytes: int
    encoder_bytes: int
    kv_cached_bytes: int
    workspace_cached_bytes: int
    non_torch_bytes: int

    # The components live tensors hold; with the allocator's cache and non-torch memory, the
    # components that sum to used_bytes, in this order.
    ALLOCATED = ("weights", "kv", "activation", "attention", "encoder")
    CACHED = ("kv_cached", "workspace_cached")
    COMPONENTS = (*ALLOCATED, *CACHED, "non_torch")

    @property
    def allocated_bytes(self) -> int:
        return sum(getattr(self, f"{name}_bytes") for name in self.ALLOCATED)

    @property
    def reserved_bytes(self) -> int:
        return self.allocated_bytes + self.kv_cached_bytes + self.workspace_cached_bytes

    @property
    def used_bytes(self) -> int:
        return self.reserved_bytes + self.non_torch_bytes

    def components(self) -> dict[str, int]:
        return dict(zip(self.COMPONENTS, self.row(), strict=True))

    def row(self) -> tuple[int, ...]:
        """The components' bytes, in ``COMPONENTS`` order."""
        return (self.weights_bytes, self.kv_bytes, self.activation_bytes, self.attention_bytes,
                self.encoder_bytes, self.kv_cached_bytes, self.workspace_cached_bytes,
                self.non_torch_bytes)


def causal_pairs(start: int, num_tokens: int, window: int | None = None) -> int:
    """Query x key pairs of causal attention for ``num_tokens`` new tokens after ``start``
    cached ones: query ``i`` of the chunk sees ``start + i + 1`` keys, at most ``window``."""
    full = num_tokens * start + num_tokens * (num_tokens + 1) // 2
    if window is None or start + num_tokens <= window:
        return full
    if start >= window:
        return num_tokens * window
    # Queries up to position window - 1 see all keys before them, the rest see window each.
    under = window - start
    return under * start + under * (under + 1) // 2 + (num_tokens - under) * window


def keys_read(start: int, num_tokens: int, window: int | None = None) -> int:
    """KV positions a chunk of ``num_tokens`` queries after ``start`` cached tokens reads:
    all of them, or with a ``window`` only those its queries can see."""
    end = start + num_tokens
    return end if window is None else end - max(0, start + 1 - window)


@dataclass(slots=True)
class BatchShape:
    """What one step computed; the cost model and the virtual clock read it.

    ``context_tokens`` sums, over scheduled sequences, the KV positions attention reads
    (cached context plus the new tokens); ``attn_pairs`` sums query x key pairs;
    ``copied_bytes`` and ``map_ops`` are the KV copies and virtual-memory map/unmap calls
    (all tensor-parallel ranks together) the step waits for; ``load_s`` its loads of KV
    from offload tiers.
    """

    num_seqs: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    context_tokens: int = 0
    attn_pairs: int = 0
    decode_pairs: int = 0  # of attn_pairs, those of decoding sequences (one query each)
    # The same three, within the window of a model's sliding-window layers where others
    # read their whole context (ModelPreset.split_window; 0 for any other model).
    window_context_tokens: int = 0
    window_pairs: int = 0
    window_decode_pairs: int = 0
    copied_bytes: int = 0
    map_ops: int = 0
    # Seconds of KV loads from offload tiers the step needs before its prefill, and
    # whether they overlap compute layer by layer (else the step waits for them first).
    load_s: float = 0.0
    load_layerwise: bool = False

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(slots=True)
class Finished:
    """A request that completed (all samples), was rejected, or failed (``error``: a served
    engine's HTTP status, timeout or dropped connection) this step. ``cached_tokens`` is
    None where the engine does not say."""

    request_id: str
    output_digest: str | None = None
    cached_tokens: int | None = 0
    rejected: str | None = None
    error: str | None = None


@dataclass(slots=True)
class Stamps:
    """Exact ``time.perf_counter()`` times of what a step reports, from engines whose events
    happen between steps (a live server's streamed chunks): ``tokens[rid]`` holds one time
    per token of ``StepReport.tokens[rid]``, ``finished[rid]`` the end of each completed
    request, ``sent[rid]`` when a request actually left for the server (its latencies count
    from then, as ``vllm bench serve`` counts them). The harness uses them instead of the
    step's end time."""

    tokens: dict[str, list[float]] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class StepReport:
    """What happened in one engine step.

    ``tokens`` maps request id -> tokens emitted this step (all samples together);
    ``first_token`` holds the ids whose first output token was emitted this step;
    ``scheduled_first`` the ids scheduled for the first time.
    """

    tokens: dict[str, int] = field(default_factory=dict)
    first_token: set[str] = field(default_factory=set)
    scheduled_first: set[str] = field(default_factory=set)
    finished: list[Finished] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    kv: KVStats | None = None
    batch: BatchShape = field(default_factory=BatchShape)
    device: DeviceMemory | None = None
    stamps: Stamps | None = None
    # Virtual seconds the step took, from an engine that keeps its own time (a cluster of
    # replicas on one clock, whose step ends at the next replica's step end or arrival);
    # None: the cost model's time of ``batch``.
    elapsed_s: float | None = None


@dataclass(slots=True)
class FastPath:
    """How the harness may take an engine's steps other than one call of ``step`` at a time,
    every step still logged and timed as if it were (see :meth:`Engine.fast_path`).

    ``mode`` goes into the run record: ``"on"``, or ``"unsupported: <why>"``. With
    ``replay``, each wave is driven through it (an event replay's ``advance``); with
    ``jump``, the harness asks before each step for the steps up to the next arrival
    (``jump(now_s, due_s)``), which come back as one block to log, or None when the next step
    must run alone. ``counted`` gives the steps an engine took in bulk inside its own steps
    (a cluster's replicas)."""

    mode: str
    replay: Any = None
    jump: Callable[[float, float], Any] | None = None
    counted: Callable[[], int] | None = None


class Engine(Protocol):
    """An inference engine driven step by step by the harness. Engines subclass it to
    inherit the defaults below."""

    name: str
    # The engine's records point into the run's step log by step index (a cluster's), so the
    # harness keeps every step rather than folding the oldest into running sums.
    keeps_steps: ClassVar[bool] = False

    def add(self, request: Request) -> None: ...

    def step(self) -> StepReport: ...

    def has_unfinished(self) -> bool: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """The engine's configuration as JSON-able data (goes into the run record)."""
        ...

    def fast_path(self, cost: CostModel, requests: list[Request], waves: int,
                  arrivals_known: bool) -> FastPath:
        """How far this engine can safely jump past single steps under a virtual clock timed
        by ``cost``, running ``requests`` ``waves`` times; ``arrivals_known``: requests are
        added at their own arrival times (one wave, no concurrency limit)."""
        return FastPath("unsupported: the engine steps one at a time")

    def trace_prefix_accesses(self, on: bool) -> None:
        """Before a run: whether to record the prefix cache's block accesses for
        :meth:`prefix_oracle` (they cost memory that grows with the run)."""

    def prefix_oracle(self) -> PrefixOracle | None:
        """After a run: the best hit rate a prefix cache of this engine's size could have had
        on the run's block accesses (:mod:`kvbench.engines.kv.oracle`), or None where the
        engine keeps no prefix cache or no record of its accesses."""
        return None
