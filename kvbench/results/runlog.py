"""The in-memory log of one engine's run, as the harness fills it and records are built
from it: per-request timings, per-step columns, what stayed after each wave, and telemetry
samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from kvbench.engines.base import KVStats
from kvbench.engines.sim.device_memory import DeviceOutOfMemory
from kvbench.results.columns import Column
from kvbench.results.gaps import GapLog
from kvbench.results.stepstats import Folded
from kvbench.workloads.model import Request, Workload

RunStatus = Literal["ok", "interrupted", "failed"]


@dataclass(slots=True)
class RequestTiming:
    """One request's timings: when it was first scheduled, emitted its first token and
    finished; how many output tokens it emitted and the step and time of the last (its
    inter-token gaps go to the step log's :class:`~kvbench.results.gaps.GapLog` as they
    come, so a long replay holds a few numbers per request, not one per token)."""

    request: Request
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0
    last_step: int = -1
    last_token_s: float | None = None
    preemptions: int = 0
    cached_tokens: int | None = 0
    output_digest: str | None = None
    rejected: str | None = None
    error: str | None = None

    @property
    def status(self) -> str:
        if self.rejected is not None:
            return "rejected"
        if self.error is not None:
            return "failed"
        return "ok" if self.finish_s is not None else "unfinished"

    @property
    def output_tokens_emitted(self) -> int:
        return self.tokens

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (finish - first token) / (output - 1), for
        completed requests with more than one output token (``vllm bench serve``'s TPOT)."""
        out = self.request.output_tokens
        if self.finish_s is None or self.first_token_s is None or out < 2:
            return None
        return (self.finish_s - self.first_token_s) / (out - 1)


def _float_column() -> Column:
    return Column(np.float64)


@dataclass(slots=True)
class StepLog:
    """Per-step columns (time is the step's end in the clock's seconds), each a
    :class:`~kvbench.results.columns.Column`."""

    t_s: Column = field(default_factory=_float_column)
    dt_s: Column = field(default_factory=_float_column)
    num_tokens: Column = field(default_factory=Column)
    running: Column = field(default_factory=Column)
    waiting: Column = field(default_factory=Column)
    preempted: Column = field(default_factory=Column)
    kv_capacity_bytes: Column = field(default_factory=Column)
    kv_reserved_bytes: Column = field(default_factory=Column)
    kv_used_bytes: Column = field(default_factory=Column)
    kv_reserved_ahead_bytes: Column = field(default_factory=Column)
    kv_free_bytes: Column = field(default_factory=Column)
    kv_largest_free_bytes: Column = field(default_factory=Column)
    kv_shared_bytes: Column = field(default_factory=Column)
    prefix_hit_tokens: Column = field(default_factory=Column)
    block_allocs: Column = field(default_factory=Column)
    block_frees: Column = field(default_factory=Column)
    kv_copied_bytes: Column = field(default_factory=Column)
    page_table_entries: Column = field(default_factory=Column)
    # Admission refusals by the KV manager (KVStats.refused_*): 0 in steps without one.
    kv_refused_bytes: Column = field(default_factory=Column)
    kv_refused_free_bytes: Column = field(default_factory=Column)
    kv_refused_largest_free_bytes: Column = field(default_factory=Column)
    # Encoder outputs kept for reuse (KVStats.encoder_cache_bytes), and per page class of a
    # modality-aware pool ``<class>_<reserved|used|capacity>_bytes``.
    kv_encoder_cache_bytes: Column = field(default_factory=Column)
    kv_class_bytes: dict[str, Column] = field(default_factory=dict)
    # Used KV bytes by the modality of the tokens held (``text``, ``image``, ``audio``; None
    # in steps where the engine cannot attribute them), and the facts of where each
    # modality is stored (KVStats.modalities without the per-step counts).
    kv_modality_bytes: dict[str, Column] = field(default_factory=dict)
    kv_modalities: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per kind of layer group (KVStats.groups, the groups of a kind summed): reserved and
    # used bytes and pool usage, ``<kind>_<reserved_bytes|used_bytes|usage>``.
    kv_groups: dict[str, Column] = field(default_factory=dict)
    # Bytes each offload tier below device memory holds, by tier kind (KVStats.offload_tiers).
    offload_bytes: dict[str, Column] = field(default_factory=dict)
    # The requests' inter-token gaps, by step (ITL).
    gaps: GapLog = field(default_factory=GapLog)
    # Modelled device memory at each step's peak (engines that model it: the simulator),
    # one column per DeviceMemory component, summed over the tensor-parallel ranks.
    device: dict[str, Column] = field(default_factory=dict)
    device_ranks: int = 1
    # The oldest steps of a long replay, folded out of the columns (kvbench.results.stepstats):
    # the columns then hold the steps from ``len(self) - len(self.t_s)`` on.
    folded: Folded | None = None

    def __len__(self) -> int:
        return len(self.t_s) + (self.folded.steps if self.folded is not None else 0)


@dataclass(slots=True)
class WaveEnd:
    """What stayed after a wave drained: the KV snapshot and the latest probe readings."""

    step: int
    t_s: float
    kv: KVStats | None
    memory: dict[str, int]


@dataclass(slots=True)
class ProbeSamples:
    """Readings of one probe: ``steps[i]`` is the step index after which ``rows[i]`` was read."""

    columns: tuple[str, ...]
    steps: list[int] = field(default_factory=list)
    rows: list[tuple[int, ...]] = field(default_factory=list)

    def column(self, name: str) -> list[int]:
        i = self.columns.index(name)
        return [r[i] for r in self.rows]

    def last(self) -> dict[str, int]:
        return dict(zip(self.columns, self.rows[-1], strict=True)) if self.rows else {}


class TelemetryLog(Protocol):
    """A run's memory probes as the harness samples them (its ``Telemetry``) and the record
    reads them: each probe's status, constant facts and samples, keyed by step."""

    status: dict[str, str]
    samples: dict[str, ProbeSamples]
    next_due_s: float

    def sample(self, step: int, wall_s: float, force: bool = False) -> None: ...

    def info(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class EngineRun:
    engine_name: str
    workload: Workload
    clock: str
    timings: dict[str, RequestTiming]
    steps: StepLog
    last_kv: KVStats | None = None
    duration_s: float = 0.0
    wall_time_s: float = 0.0
    status: RunStatus = "ok"
    error: str | None = None
    telemetry: TelemetryLog | None = None
    warmup_step: int | None = None  # the step at whose end warm-up was over
    waves: int = 1
    wave_ends: list[WaveEnd] = field(default_factory=list)
    step_wall_s: float = 0.0  # wall time of steps incl. their logging, excl. idle waits
    telemetry_wall_s: float = 0.0  # of which: step logging and probe sampling
    # The modelled device ran out of memory (the run failed there, or never started).
    out_of_memory: DeviceOutOfMemory | None = None
    # A cluster's per-replica log (kvbench.engines.cluster.engine.ClusterLog); None for one engine.
    cluster: Any = None
    # Decode fast-forward: "on" (runs of decode-only steps taken in one go), "off" (asked
    # for step by step) or why the engine cannot; and the steps it took in bulk.
    fast_forward: str = "off"
    fast_forward_steps: int = 0
    # On the virtual clock: seconds steps waited on loads from offload tiers.
    offload_stall_s: float | None = None
    # The output-agreement check of a reduced-precision KV run (a results.build
    # QualityResult), set by the caller that made it; None where none was considered.
    quality: Any = None
    # Inter-token gaps of requests whose engine stamps token times, by request id, until it
    # completes (then they join the step log's gaps).
    stamped_gaps: dict[str, list[float]] = field(default_factory=dict)
    # On the wall clock: the machine while the engine ran (a results.schema.MachineState),
    # and the CPU seconds of this process's run loop where they are the engine's own (not
    # a served engine's client).
    machine_state: Any = None
    engine_cpu_s: float | None = None
    # MIN's hits on the run's prefix-cache accesses (a kvbench.engines.kv.oracle.PrefixOracle).
    prefix_oracle: Any = None
