"""Many replicas of a built-in engine on one virtual clock, behind a router.

A :class:`ClusterEngine` presents itself to the harness as one engine. Each replica is a
whole built-in engine (scheduler, KV manager, sim executor) with its own step in flight;
one cluster step advances the shared clock to the next event (a replica's step ending, a
KV transfer ending, or the next arrival) and reports what happened by then, with
``StepReport.elapsed_s`` telling the virtual clock how far it moved. Steps of different
replicas overlap in time as they would on separate GPUs; everything happens in a fixed
order (replicas by index, transfers first-in first-out), so a run is deterministic.

Requests are routed when they arrive:

- ``round-robin``: replicas in turn;
- ``least-outstanding``: the replica with the fewest requests routed to it and not done;
- ``least-kv``: the lowest KV load, reserved KV plus the prompts routed to it and not yet
  scheduled, as a share of its capacity;
- ``prefix-aware``: the replica whose prefix cache holds the longest prefix of the prompt's
  block hashes (read from the replicas' KV managers, as llm-d's precise prefix-cache scorer
  reads engines' KV events), among replicas under the load cap: a replica is over it when
  taking the request would leave it more than ``load_cap`` x the cluster's mean outstanding
  requests (and at least one). A request whose best-prefix replica was over the cap and
  went to another one with a shorter cached prefix counts as moved by the load cap;
- ``session-affinity``: every request of a multi-turn session to the replica its first
  request went to (chosen least-outstanding, as are requests without a session).
Ties go to the fewest outstanding requests, then the lowest index.

Disaggregated prefill/decode (``prefill_replicas`` + ``decode_replicas``): a request runs
its prefill on a prefill replica (routed as above) up to its first token; the prefill
replica then keeps the prompt's KV referenced while it is sent over the link to a decode
replica (the one with the lowest KV load): bytes = prompt tokens x KV bytes per token, each
tensor-parallel rank sending its share over its own link, transfers out of one replica and
into one replica one at a time. On receipt the decode replica allocates the KV and runs the
request's decode; the client sees the first token then (as vLLM's disaggregated proxy
streams from the decode instance), so TTFT includes the transfer. While the decode replica
has no room, the request waits and the prefill replica keeps holding its KV.

Decode fast-forward (the harness turns it on with :meth:`ClusterEngine.fast_path`):
a replica about to start a step whose run of decode-only steps the engine can take in one
go (:meth:`BuiltinEngine.plan_decode`) takes them at once, up to the first step ending at or
after the next event that may concern it: the next arrival the router may send it (for
round-robin, the next one it will; for the other routers every arrival, since they read
replicas' state or may pick it), and for a decode replica the next KV transfer's end and the
end of every prefill replica's step in flight (which may send it KV). The cluster still
takes one step per event: the run's steps start and end on the clock one after another,
each reporting the queue sizes, KV and device memory the engine computed for it, so records
equal stepping one at a time bit for bit; what goes is each replica step's scheduling and
KV bookkeeping. A prefill replica holding KV for transfers, and decode replicas while any
of them has received KV waiting for room, step one at a time (a transfer's admission frees
and allocates KV at times no run can know).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvbench.engines.base import (
    BatchShape,
    DeviceMemory,
    Engine,
    FastPath,
    Finished,
    KVStats,
    StepReport,
)
from kvbench.engines.builtin.engine import BuiltinEngine
from kvbench.engines.builtin.sim_executor import synthetic_token
from kvbench.engines.sequence import Sequence
from kvbench.engines.sim.costmodel import CostModel
from kvbench.errors import KvbenchError
from kvbench.workloads.model import Request

Router = Literal["round-robin", "least-outstanding", "least-kv", "prefix-aware",
                 "session-affinity"]
ROUTERS: tuple[str, ...] = Router.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Link:
    """A KV-transfer link: per-direction bandwidth of one GPU's link and a fixed cost per
    transfer (setup and first-byte latency)."""

    bytes_per_s: float
    latency_s: float
    source: str


# Bandwidths are the vendors' per-GPU (per-port) line rates, one direction; a transfer
# gets all of it. Latencies are order-of-magnitude figures for one RDMA/NCCL transfer's
# setup (a few microseconds on NVLink and InfiniBand, more through Ethernet switches).
LINKS: dict[str, Link] = {
    # NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s per GPU (both directions).
    "nvlink-a100": Link(300e9, 5e-6, "NVLink 3 (A100): 600 GB/s bidirectional per GPU"),
    # NVIDIA H100 SXM datasheet: fourth-generation NVLink, 900 GB/s per GPU.
    "nvlink-h100": Link(450e9, 5e-6, "NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU"),
    # InfiniBand HDR (ConnectX-6) 200 Gb/s and NDR (ConnectX-7) 400 Gb/s per port.
    "ib-hdr": Link(25e9, 5e-6, "InfiniBand HDR: 200 Gb/s per port"),
    "ib-ndr": Link(50e9, 5e-6, "InfiniBand NDR: 400 Gb/s per port"),
    # RDMA over Converged Ethernet at 100/200/400 GbE per NIC.
    "roce-100g": Link(12.5e9, 10e-6, "RoCE v2: 100 Gb/s Ethernet per NIC"),
    "roce-200g": Link(25e9, 10e-6, "RoCE v2: 200 Gb/s Ethernet per NIC"),
    "roce-400g": Link(50e9, 10e-6, "RoCE v2: 400 Gb/s Ethernet per NIC"),
}


class ClusterSection(BaseModel):
    """A suite's ``[cluster]`` table: ``replicas`` colocated replicas (1: a single engine),
    or ``prefill_replicas`` + ``decode_replicas`` disaggregated ones over ``link``."""

    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(default=1, ge=1)
    router: Router = "round-robin"
    load_cap: float = Field(default=1.5, ge=1.0, allow_inf_nan=False)
    prefill_replicas: int | None = Field(default=None, ge=1)
    decode_replicas: int | None = Field(default=None, ge=1)
    link: str = "nvlink-a100"

    @model_validator(mode="after")
    def _shape(self) -> ClusterSection:
        if (self.prefill_replicas is None) != (self.decode_replicas is None):
            raise ValueError("give both prefill_replicas and decode_replicas, or neither")
        if self.prefill_replicas is not None and self.replicas != 1:
            raise ValueError("give replicas (colocated) or prefill_replicas + "
                             "decode_replicas (disaggregated), not both")
        if self.link not in LINKS:
            raise ValueError(f"unknown link {self.link!r}; links: {', '.join(LINKS)}")
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas is not None

    @property
    def active(self) -> bool:
        """More than one engine: the run needs a cluster."""
        return self.disaggregated or self.replicas > 1

    @property
    def num_replicas(self) -> int:
        if self.prefill_replicas is not None and self.decode_replicas is not None:
            return self.prefill_replicas + self.decode_replicas
        return self.replicas


Role = Literal["replica", "prefill", "decode"]


@dataclass(slots=True)
class Transfer:
    """One request's KV on its way from a prefill replica to a decode replica."""

    request: Request
    prompt_ids: np.ndarray
    source: int
    target: int
    nbytes: int
    ready_s: float  # the prefill's end
    start_s: float
    end_s: float
    holder: Sequence  # what keeps the KV referenced on the prefill replica
    admitted_s: float | None = None


@dataclass(slots=True)
class ClusterLog:
    """What the run layer turns into record curves and metrics: each replica's queue sizes
    and KV reserved whenever they changed (``changes``: cluster step, replica, running,
    waiting, KV reserved bytes; a value holds until the next change), the router's
    counters, and every KV transfer."""

    roles: list[str]
    initial: list[tuple[int, int, int]] = field(default_factory=list)
    changes: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    num_steps: int = 0
    routed: list[int] = field(default_factory=list)
    routes: dict[str, int] = field(default_factory=dict)  # request id -> first replica
    moved_by_load_cap: int = 0
    transfers: list[Transfer] = field(default_factory=list)
    link: str | None = None

    def dense(self, n: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Running, waiting and KV reserved bytes after each of the first ``n`` steps (all
        by default), one column per replica."""
        n = self.num_steps if n is None else min(n, self.num_steps)
        cols = np.zeros((3, n, len(self.roles)), dtype=np.float64)
        cols[:, 0, :] = np.asarray(self.initial, dtype=np.float64).T if n else 0
        if self.changes and n:
            ch = np.asarray(self.changes, dtype=np.float64)
            ch = ch[ch[:, 0] < n]
            step, rep = ch[:, 0].astype(np.int64), ch[:, 1].astype(np.int64)
            for k in range(3):
                # The last change of each (step, replica) wins: changes are in order.
                cols[k, step, rep] = ch[:, 2 + k]
            changed = np.zeros((n, len(self.roles)), dtype=bool)
            changed[step, rep] = True
            changed[0, :] = True
            # Forward-fill every column from its latest change.
            idx = np.where(changed, np.arange(n)[:, None], 0)
            np.maximum.accumulate(idx, axis=0, out=idx)
            for k in range(3):
                cols[k] = np.take_along_axis(cols[k], idx, axis=0)
        return cols[0], cols[1], cols[2]


# Figures per page class, modality or offload tier of one pool are not summed over
# replicas: the cluster's KVStats leaves them None.
_KV_FIELDS = tuple(f.name for f in dataclasses.fields(KVStats)
                   if f.name not in ("classes", "modalities", "offload_tiers", "groups"))
_MAX_FIELDS = frozenset({"largest_free_bytes", "refused_largest_free_bytes"})
_MAX_INDEX = tuple((name, _KV_FIELDS.index(name)) for name in sorted(_MAX_FIELDS))
_SUM_FIELDS = tuple(n for n in _KV_FIELDS if n not in _MAX_FIELDS)
_DEVICE_FIELDS = tuple(f"{name}_bytes" for name in DeviceMemory.COMPONENTS)


class _Totals:
    """Sums over replicas kept up to date one replica at a time: a cluster step changes
    one or two replicas of many. A field any replica leaves None is None in the sum."""

    __slots__ = ("_get", "_names", "_nones", "_sums", "_vals")

    def __init__(self, names: tuple[str, ...], count: int) -> None:
        self._names = names
        self._get = operator.attrgetter(*names)
        self._sums = [0] * len(names)
        self._nones = [count] * len(names)
        self._vals: list[tuple[Any, ...]] = [(None,) * len(names)] * count

    def set(self, replica: int, obj: Any) -> None:
        old = self._vals[replica]
        new = self._get(obj)
        if new == old:
            return
        self._vals[replica] = new
        if None not in old and None not in new:
            self._sums = [s - a + b for s, a, b in zip(self._sums, old, new, strict=True)]
            return
        sums, nones = self._sums, self._nones
        for j, (a, b) in enumerate(zip(old, new, strict=True)):
            if a is None:
                nones[j] -= 1
            else:
                sums[j] -= a
            if b is None:
                nones[j] += 1
            else:
                sums[j] += b

    def values(self) -> list[Any]:
        """The sums in field order (None where any replica has None)."""
        out = [None if k else v for v, k in zip(self._sums, self._nones, strict=True)]
        for j, v in enumerate(out):
            if type(v) is float:  # a running float sum's rounding follows the updates' order
                out[j] = sum(vals[j] for vals in self._vals)
        return out

    def column_max(self, j: int) -> int | None:
        vals = [v[j] for v in self._vals]
        if None in vals:
            return None
        return max(vals)  # type: ignore[type-var]


@dataclass(slots=True)
class _Run:
    """A replica's decode steps taken in one go: step ``j`` starts at ``ends[j]`` and ends at
    ``ends[j + 1]``; ``next`` is the step to start next."""

    ends: list[float]
    steps: int
    num_seqs: int
    context: list[int]
    pairs: list[int]
    tokens: dict[str, int]
    running: int
    waiting: int
    kv: dict[str, list[int]]  # the KVStats fields that change in the run, by step
    device: list[DeviceMemory] | None  # by step, or one for every step
    stats: KVStats
    next: int = 0


@dataclass(slots=True)
class QuietSteps:
    """Cluster steps taken in one call (:meth:`ClusterEngine.quiet_steps`), one entry per
    step: what each step's report would say. ``kv`` rows hold the KVStats fields in order,
    ``device`` rows the DeviceMemory components; ``tokens`` the tokens each step emitted, by
    request; no request started, finished or was preempted in them. ``kv_fields`` names the
    KVStats fields of the ``kv`` rows (the rest are None)."""

    elapsed_s: list[float] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    kv: list[list[Any]] = field(default_factory=list)
    device: list[list[Any]] = field(default_factory=list)
    tokens: list[dict[str, int]] = field(default_factory=list)
    device_ranks: int = 1
    kv_fields: tuple[str, ...] = ()


# What a replica in flight holds while its step is one of a run's (the run has the rest).
_RUN_STEP = StepReport(elapsed_s=0.0)


class _Replica:
    __slots__ = ("busy_until", "device", "engine", "holds", "in_free_s", "index", "inflight",
                 "kv", "out_free_s", "outstanding", "own_hits", "own_queries", "pending",
                 "received", "role", "run", "running", "waiting")

    def __init__(self, index: int, engine: BuiltinEngine, role: Role) -> None:
        self.index, self.engine, self.role = index, engine, role
        self.inflight: StepReport | None = None
        self.busy_until = 0.0
        self.kv: KVStats = engine.kv.stats()
        self.running = self.waiting = 0
        self.device: DeviceMemory = engine.executor.step_memory()
        self.outstanding = 0
        # Prompt bytes routed here and not yet scheduled, by request id (least-kv).
        self.pending: dict[str, int] = {}
        self.received: deque[Transfer] = deque()  # transfers done, waiting for room
        self.in_free_s = self.out_free_s = 0.0
        self.run: _Run | None = None  # decode steps taken in one go (fast-forward)
        self.holds = 0  # KV held for transfers out of this replica
        # Prefix-cache lookups the cluster made itself (holding KV for a transfer, receiving
        # it): not the scheduler's, so left out of the hit rate.
        self.own_hits = self.own_queries = 0

    def observe(self, kv: KVStats) -> None:
        """Take ``kv`` as this replica's KV, less the cluster's own prefix lookups."""
        if self.own_queries and kv.prefix_query_tokens is not None:
            kv = dataclasses.replace(
                kv, prefix_hit_tokens=(kv.prefix_hit_tokens or 0) - self.own_hits,
                prefix_query_tokens=kv.prefix_query_tokens - self.own_queries)
        self.kv = kv

    def own_lookup(self, before: KVStats) -> None:
        """Count the prefix lookups made since ``before`` as the cluster's own."""
        after = self.engine.kv.stats()
        if after.prefix_query_tokens is not None and before.prefix_query_tokens is not None:
            self.own_hits += (after.prefix_hit_tokens or 0) - (before.prefix_hit_tokens or 0)
            self.own_queries += after.prefix_query_tokens - before.prefix_query_tokens
        self.observe(after)

    def kv_load(self) -> float:
        cap = self.kv.capacity_bytes or 1
        return ((self.kv.reserved_bytes or 0) + sum(self.pending.values())) / cap


class _Router:
    def __init__(self, kind: str, load_cap: float) -> None:
        self.kind, self.load_cap = kind, load_cap
        self._next = 0
        self._sessions: dict[str, int] = {}
        self.moved = 0

    def choose(self, request: Request, prompt_ids: np.ndarray, reps: list[_Replica]) -> int:
        """The index in ``reps`` the request goes to."""
        kind = self.kind
        if kind == "round-robin":
            i, self._next = self._next % len(reps), self._next + 1
            return i
        if kind == "least-kv":
            return _least_kv(reps)
        if kind == "prefix-aware":
            return self._prefix(prompt_ids, reps)
        if kind == "session-affinity" and request.session_id is not None:
            sid = request.session_id
            if sid not in self._sessions:
                self._sessions[sid] = _least_outstanding(reps)
            return self._sessions[sid]
        return _least_outstanding(reps)

    def _prefix(self, prompt_ids: np.ndarray, reps: list[_Replica]) -> int:
        match = [r.engine.kv.cached_prefix_tokens(prompt_ids) for r in reps]
        total = sum(r.outstanding for r in reps)
        cap = max(1.0, self.load_cap * (total + 1) / len(reps))
        order = sorted(range(len(reps)), key=lambda i: (-match[i], reps[i].outstanding, i))
        under = [i for i in order if reps[i].outstanding + 1 <= cap]
        chosen = under[0] if under else _least_outstanding(reps)
        if match[order[0]] > match[chosen]:
            self.moved += 1
        return chosen


def _least_outstanding(reps: list[_Replica]) -> int:
    return min(range(len(reps)), key=lambda i: (reps[i].outstanding, i))


def _least_kv(reps: list[_Replica]) -> int:
    return min(range(len(reps)), key=lambda i: (reps[i].kv_load(), reps[i].outstanding, i))


def _add_batch(total: BatchShape, b: BatchShape) -> None:
    total.num_seqs += b.num_seqs
    total.prefill_tokens += b.prefill_tokens
    total.decode_tokens += b.decode_tokens
    total.context_tokens += b.context_tokens
    total.attn_pairs += b.attn_pairs
    total.decode_pairs += b.decode_pairs
    total.window_context_tokens += b.window_context_tokens
    total.window_pairs += b.window_pairs
    total.window_decode_pairs += b.window_decode_pairs
    total.copied_bytes += b.copied_bytes


class ClusterEngine(Engine):
    """Replicas of one built-in engine behind a router on one virtual clock (see the
    module docstring). ``arrivals`` are the workload's arrival times: a step never runs
    past the next one, so a request reaches an idle replica when it arrives."""

    keeps_steps = True  # its log's replica changes name steps of the run's log

    def __init__(
        self,
        name: str,
        replicas: list[BuiltinEngine],
        section: ClusterSection,
        cost: CostModel,
        arrivals: list[float] | None = None,
    ) -> None:
        if any(r.executor.device != "sim" for r in replicas):
            raise KvbenchError("a cluster runs its replicas under the sim executor: use "
                               "--device sim:GPU")
        self.name = name
        self.section = section
        self._cost = cost
        self._tp = cost.tp
        self._arrivals = sorted(arrivals or [])
        n_prefill = section.prefill_replicas or 0
        roles: list[Role] = (["prefill"] * n_prefill + ["decode"] * (len(replicas) - n_prefill)
                             if section.disaggregated else ["replica"] * len(replicas))
        self._reps = [_Replica(i, e, role) for i, (e, role) in
                      enumerate(zip(replicas, roles, strict=True))]
        self._front = [r for r in self._reps if r.role != "decode"]
        self._back = [r for r in self._reps if r.role == "decode"]
        self._vocab = replicas[0].preset.vocab_size
        self._router = _Router(section.router, section.load_cap)
        self._link = LINKS[section.link] if section.disaggregated else None
        self._transfers: list[Transfer] = []  # on the link, by end time
        self._holding: dict[str, Transfer] = {}
        self._originals: dict[str, Request] = {}
        self._holder_ids = 0
        self._t = 0.0
        self._added = 0  # requests added so far (the next arrival is _arrivals[_added])
        self._bulk = False  # decode fast-forward (fast_path turns it on)
        self.fast_forward_steps = 0  # replica steps taken as parts of runs
        self._open = 0  # requests added and not yet reported finished
        self._ready: set[int] = set()  # replicas that may have work to start
        self._busy: list[tuple[float, int]] = []  # (step end, replica): a heap
        self._changed: set[int] = set()
        n = len(self._reps)
        self._kv = _Totals(_KV_FIELDS, n)
        self._device = _Totals(_DEVICE_FIELDS, n)
        for rep in self._reps:
            self._kv.set(rep.index, rep.kv)
            self._device.set(rep.index, rep.device)
        self._running = self._waiting = 0
        self.log = ClusterLog([r.role for r in self._reps], routed=[0] * n,
                              link=section.link if section.disaggregated else None)
        self.log.initial = [(0, 0, r.kv.reserved_bytes or 0) for r in self._reps]

    # -- the Engine protocol ---------------------------------------------------------------

    def fast_path(self, cost: CostModel, requests: list[Request], waves: int,
                  arrivals_known: bool) -> FastPath:
        """Replicas' decode runs taken in one go inside the cluster's steps, and quiet
        stretches of cluster steps taken in one call (see the module docstring), given that
        requests are added at the arrival times the cluster was built with
        (``arrivals_known``)."""
        if not arrivals_known or not self._arrivals:
            return FastPath("unsupported: the cluster steps one at a time when it does not "
                            "know the arrivals ahead (several waves or a concurrency limit)")
        for rep in self._reps:
            reason = rep.engine.fast_forward_blocker()
            if reason is not None:
                return FastPath(f"unsupported: {reason}")
        self._bulk = True
        return FastPath("on", jump=lambda _now, due: self.quiet_steps(due),
                        counted=lambda: self.fast_forward_steps)

    def add(self, request: Request) -> None:
        self._added += 1
        self._t = max(self._t, request.arrival_s)
        ids = request.prompt_token_ids(self._vocab)
        front = self._front
        rep = front[self._router.choose(request, ids, front)]
        self.log.routed[rep.index] += 1
        self.log.routes[request.id] = rep.index
        rep.outstanding += 1
        rep.pending[request.id] = request.prompt_tokens * rep.engine.kv.bytes_per_token
        if rep.role == "prefill" and request.output_tokens > 1:
            if request.n > 1:
                raise KvbenchError(f"request {request.id}: disaggregated prefill runs one "
                                   "sample per request (n = 1)")
            self._originals[request.id] = request
            request = dataclasses.replace(request, output_tokens=1)
        rep.engine.add(request)
        self._open += 1
        self._ready.add(rep.index)

    def has_unfinished(self) -> bool:
        return self._open > 0

    def step(self) -> StepReport:
        t0 = self._t
        out = StepReport(elapsed_s=0.0)
        reps = self._reps
        if self._ready:
            ready = sorted(self._ready)
            self._ready.clear()
            for i in ready:
                rep = reps[i]
                if rep.inflight is None and rep.engine.has_unfinished():
                    self._start(rep, t0, out)
        busy = self._busy
        t1 = busy[0][0] if busy else None
        if self._transfers and (t1 is None or self._transfers[0].end_s < t1):
            t1 = self._transfers[0].end_s
        k = bisect.bisect_right(self._arrivals, t0)
        if k < len(self._arrivals) and (t1 is None or self._arrivals[k] < t1):
            t1 = self._arrivals[k]
        if t1 is None:
            t1 = t0
        while busy and busy[0][0] <= t1:
            _, i = heapq.heappop(busy)
            rep = reps[i]
            report, rep.inflight = rep.inflight, None
            assert report is not None
            if report is _RUN_STEP:
                self._end_run_step(rep, out.tokens)
            else:
                self._finish(rep, report, t1, out)
            self._ready.add(i)
        while self._transfers and self._transfers[0].end_s <= t1:
            tr = self._transfers.pop(0)
            reps[tr.target].received.append(tr)
            self._ready.add(tr.target)
        for rep in self._back:
            if rep.received:
                self._admit(rep, t1, out)
        self._t = t1
        out.elapsed_s = t1 - t0
        self._open -= len(out.finished)
        log = self.log
        step = log.num_steps
        for i in sorted(self._changed):
            rep = reps[i]
            self._kv.set(i, rep.kv)
            self._device.set(i, rep.device)
            log.changes.append((step, i, rep.running, rep.waiting, rep.kv.reserved_bytes or 0))
        self._changed.clear()
        log.num_steps = step + 1
        log.moved_by_load_cap = self._router.moved
        out.num_running, out.num_waiting = self._running, self._waiting
        kv = KVStats(**dict(zip(_KV_FIELDS, self._kv.values(), strict=True)))
        for name, j in _MAX_INDEX:
            setattr(kv, name, self._kv.column_max(j))
        out.kv = kv
        out.device = DeviceMemory(self._tp * len(reps), *self._device.values())
        return out

    def close(self) -> None:
        for rep in self._reps:
            rep.engine.close()

    def trace_prefix_accesses(self, on: bool) -> None:
        # A cluster's caches are its replicas': it records no oracle of its own.
        for rep in self._reps:
            rep.engine.trace_prefix_accesses(False)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cluster": {**self.section.model_dump(), "roles": self.log.roles},
            "replica": self._reps[0].engine.describe(),
        }
        if self._link is not None:
            out["cluster"]["link_bytes_per_s"] = self._link.bytes_per_s
            out["cluster"]["link_latency_s"] = self._link.latency_s
            out["cluster"]["link_source"] = self._link.source
        return out

    def quiet_steps(self, due_s: float, limit: int = 4096) -> QuietSteps | None:
        """Take the next cluster steps, at most ``limit``, while nothing happens in them but
        replicas' decode runs starting and ending steps (no request added, finished or
        admitted, no transfer ending: nothing the harness must see one step at a time,
        ``due_s`` being the next arrival it would add), as :meth:`step` would take them;
        None when the next step is not such a one. Only with fast-forward on."""
        if not self._bulk:
            return None
        out: QuietSteps | None = None
        reps, busy, arrivals = self._reps, self._busy, self._arrivals
        log = self.log
        while out is None or len(out.elapsed_s) < limit:
            if not self._ready or (self._back and any(r.received for r in self._back)):
                break
            t0 = self._t
            starts = []
            t1 = busy[0][0] if busy else math.inf
            quiet = True
            for i in self._ready:
                rep = reps[i]
                if rep.inflight is not None:
                    continue
                run = rep.run
                if run is None:
                    if rep.engine.has_unfinished():
                        quiet = False
                        break
                    continue
                starts.append(i)
                t1 = min(t1, run.ends[run.next + 1])
            if not quiet or not starts or due_s <= t1:
                break
            if self._transfers and self._transfers[0].end_s <= t1:
                break
            k = bisect.bisect_right(arrivals, t0)
            if k < len(arrivals) and arrivals[k] <= t1:
                break
            if any(t <= t1 and reps[i].inflight is not _RUN_STEP for t, i in busy):
                break
            if out is None:
                out = QuietSteps()
            self._ready = set()
            num_tokens = 0
            for i in sorted(starts):
                rep = reps[i]
                num_tokens += rep.run.num_seqs  # type: ignore[union-attr]
                self._run_step(rep, None)
            tokens: dict[str, int] = {}
            while busy and busy[0][0] <= t1:
                _, i = heapq.heappop(busy)
                rep = reps[i]
                rep.inflight = None
                self._end_run_step(rep, tokens)
                self._ready.add(i)
            self._t = t1
            step = log.num_steps
            for i in sorted(self._changed):
                rep = reps[i]
                self._kv.set(i, rep.kv)
                self._device.set(i, rep.device)
                log.changes.append((step, i, rep.running, rep.waiting,
                                    rep.kv.reserved_bytes or 0))
            self._changed.clear()
            log.num_steps = step + 1
            kv = self._kv.values()
            for _, j in _MAX_INDEX:
                kv[j] = self._kv.column_max(j)
            out.elapsed_s.append(t1 - t0)
            out.num_tokens.append(num_tokens)
            out.running.append(self._running)
            out.waiting.append(self._waiting)
            out.kv.append(kv)
            out.device.append(self._device.values())
            out.tokens.append(tokens)
        if out is not None:
            out.device_ranks = self._tp * len(reps)
            out.kv_fields = _KV_FIELDS
        return out

    # -- events ----------------------------------------------------------------------------

    def _set_queues(self, rep: _Replica, running: int, waiting: int) -> None:
        self._running += running - rep.running
        self._waiting += waiting - rep.waiting
        rep.running, rep.waiting = running, waiting
        self._changed.add(rep.index)

    def _start(self, rep: _Replica, t0: float, out: StepReport) -> None:
        """Run ``rep``'s next step from ``t0``; its results show at its end."""
        if rep.run is None and self._bulk and self._may_run(rep):
            self._plan_run(rep, t0)
        if rep.run is not None:
            self._run_step(rep, out.batch)
            return
        report = rep.engine.step()
        out.scheduled_first |= report.scheduled_first
        for rid in report.scheduled_first:
            rep.pending.pop(rid, None)
        out.preempted_ids += report.preempted_ids
        out.num_preempted += report.num_preempted
        _add_batch(out.batch, report.batch)
        if report.kv is not None:
            rep.observe(report.kv)
        if report.device is not None:
            rep.device = report.device
        self._set_queues(rep, report.num_running, report.num_waiting)
        dt = self._cost.step_time_s(report.batch)
        if dt > 0:
            rep.inflight, rep.busy_until = report, t0 + dt
            heapq.heappush(self._busy, (rep.busy_until, rep.index))
        else:
            # Nothing computed (rejections only, or nothing fits): no time passes for it,
            # and it waits for something to change (an arrival, KV freed by a transfer).
            self._finish(rep, report, t0, out)

    # -- decode fast-forward ---------------------------------------------------------------

    def _may_run(self, rep: _Replica) -> bool:
        if rep.role == "prefill":
            return rep.holds == 0
        if rep.role == "decode":
            return not any(r.received for r in self._back)
        return True

    def _horizon(self, rep: _Replica) -> float:
        """The next time something outside ``rep`` may change what it does."""
        arrivals, k = self._arrivals, self._added
        if rep.role != "decode" and self._router.kind == "round-robin":
            # The j-th request from now goes to front replica (next + j) mod n.
            k += (rep.index - self._router._next) % len(self._front)
        h = arrivals[k] if k < len(arrivals) else math.inf
        if rep.role == "decode":
            if self._transfers:
                h = min(h, self._transfers[0].end_s)
            for r in self._front:
                if r.inflight is not None:
                    h = min(h, r.busy_until)
        return h

    def _plan_run(self, rep: _Replica, t0: float) -> None:
        engine = rep.engine
        plan = engine.plan_decode()
        if plan is None:
            return
        dts = self._cost.decode_step_times(plan.num_seqs, plan.context, plan.pairs)
        if dts is None:
            return
        ends = np.cumsum(np.concatenate(([t0], dts)))
        k = plan.max_steps
        h = self._horizon(rep)
        if h != math.inf:
            # The first step ending at or after h is the last one that starts before it.
            k = min(k, int(np.searchsorted(ends[1:], h, side="left")) + 1)
        done = engine.advance_decode(k)
        if done is None:
            return
        k = done.steps
        # One KV snapshot for the run: the columns that stay put set once, the others at
        # each step; device memory read once when every step's is alike.
        stats = dataclasses.replace(done.last_kv)
        # Per-modality and per-tier figures are not summed over replicas (see _KV_FIELDS).
        columns = {k: v.tolist() if isinstance(v, np.ndarray) else v
                   for k, v in done.kv.items() if ":" not in k}
        encoder = done.device.get("encoder")
        if encoder is not None:
            columns["encoder_cache_bytes"] = encoder.tolist()
        varying = {}
        for name, column in columns.items():
            if column.count(column[0]) == k:
                setattr(stats, name, column[0])
            else:
                varying[name] = column
        rows: list[DeviceMemory] | None = None
        if done.device:
            values = list(zip(*(done.device[name].tolist()
                                for name in DeviceMemory.COMPONENTS), strict=True))
            rows = ([DeviceMemory(done.device_ranks, *values[0])]
                    if values.count(values[0]) == k else
                    [DeviceMemory(done.device_ranks, *v) for v in values])
        rep.run = _Run(ends[: k + 1].tolist(), k, plan.num_seqs, plan.context[:k].tolist(),
                       plan.pairs[:k].tolist(), done.tokens, done.num_running,
                       done.num_waiting, varying, rows, stats)

    def _run_step(self, rep: _Replica, b: BatchShape | None) -> None:
        """Start the next step of ``rep``'s run, as :meth:`_start` would have (its batch
        added to ``b``, when given)."""
        run = rep.run
        assert run is not None
        j = run.next
        run.next = j + 1
        # One snapshot per run, set to each step's values in turn (nothing keeps it).
        kv = run.stats
        for name, column in run.kv.items():
            setattr(kv, name, column[j])
        rep.observe(kv)
        device = run.device
        if device is not None:
            rep.device = device[j] if len(device) > 1 else device[0]
        if rep.running != run.running or rep.waiting != run.waiting:
            self._set_queues(rep, run.running, run.waiting)
        else:
            self._changed.add(rep.index)
        if b is not None:
            n = run.num_seqs
            b.num_seqs += n
            b.decode_tokens += n
            b.context_tokens += run.context[j]
            b.attn_pairs += run.pairs[j]
            b.decode_pairs += run.pairs[j]
        rep.inflight, rep.busy_until = _RUN_STEP, run.ends[j + 1]
        heapq.heappush(self._busy, (rep.busy_until, rep.index))
        self.fast_forward_steps += 1

    def _end_run_step(self, rep: _Replica, tokens: dict[str, int]) -> None:
        run = rep.run
        assert run is not None
        holding = self._holding if rep.role == "prefill" else None
        for rid, n in run.tokens.items():
            if holding is None or rid not in holding:
                tokens[rid] = tokens.get(rid, 0) + n
        if run.next == run.steps:
            rep.run = None

    def _finish(self, rep: _Replica, report: StepReport, t1: float, out: StepReport) -> None:
        """Fold ``rep``'s step that ended at ``t1`` into the cluster's report."""
        for fin in report.finished:
            rep.pending.pop(fin.request_id, None)
            rep.outstanding -= 1
        if rep.role != "prefill":
            _merge_outputs(out, report, report.finished)
            return
        passed = []
        for fin in report.finished:
            original = self._originals.pop(fin.request_id, None)
            if original is None or fin.rejected is not None or fin.error is not None:
                passed.append(fin)
            else:
                self._send(rep, original, t1)
        keep = {f.request_id for f in passed}
        # A request's first token reaches the client from its decode replica.
        tokens = {rid: n for rid, n in report.tokens.items()
                  if rid in keep or rid not in self._holding}
        for rid, n in tokens.items():
            out.tokens[rid] = out.tokens.get(rid, 0) + n
        out.first_token |= {rid for rid in report.first_token if rid in tokens}
        out.finished += passed

    def _send(self, rep: _Replica, request: Request, t: float) -> None:
        """Hold ``request``'s prompt KV on ``rep`` and start sending it to a decode
        replica."""
        assert self._link is not None
        kv = rep.engine.kv
        ids = request.prompt_token_ids(self._vocab)
        self._holder_ids -= 1
        holder = Sequence(self._holder_ids, request, ids)
        before = kv.stats()
        cached = kv.lookup_prefix(holder)
        if not kv.allocate(holder, cached, len(ids) - cached):
            raise RuntimeError(f"prefill replica {rep.index} could not hold the KV of "
                               f"{request.id} it has just computed")
        rep.own_lookup(before)
        rep.holds += 1
        self._changed.add(rep.index)
        target = self._back[_least_kv(self._back)]
        target.outstanding += 1
        nbytes = len(ids) * kv.bytes_per_token * self._tp
        start = max(t, rep.out_free_s, target.in_free_s)
        end = start + self._link.latency_s + nbytes / self._tp / self._link.bytes_per_s
        rep.out_free_s = target.in_free_s = end
        tr = Transfer(request, ids, rep.index, target.index, nbytes, t, start, end, holder)
        target.pending[request.id] = len(ids) * kv.bytes_per_token
        self._holding[request.id] = tr
        bisect.insort(self._transfers, tr, key=lambda x: x.end_s)
        self.log.transfers.append(tr)

    def _admit(self, rep: _Replica, t: float, out: StepReport) -> None:
        """Admit the KV ``rep`` received, in order, while it fits."""
        changed = False
        while rep.received:
            tr = rep.received[0]
            before = rep.engine.kv.stats()
            first = synthetic_token(tr.request.id, len(tr.prompt_ids) + 1, self._vocab)
            if not rep.engine.scheduler.admit_computed(tr.request, tr.prompt_ids, [first],
                                                      len(tr.prompt_ids)):
                break
            rep.received.popleft()
            rep.own_lookup(before)
            changed = True
            tr.admitted_s = t
            rep.pending.pop(tr.request.id, None)
            source = self._reps[tr.source]
            source.engine.kv.free(tr.holder)
            source.holds -= 1
            source.observe(source.engine.kv.stats())
            self._changed.add(source.index)
            self._ready.add(source.index)
            del self._holding[tr.request.id]
            rid = tr.request.id
            out.tokens[rid] = out.tokens.get(rid, 0) + 1
            out.first_token.add(rid)
        if changed:
            self._set_queues(rep, rep.engine.scheduler.num_running_requests, rep.waiting)
            self._ready.add(rep.index)


def _merge_outputs(out: StepReport, report: StepReport, finished: list[Finished]) -> None:
    for rid, n in report.tokens.items():
        out.tokens[rid] = out.tokens.get(rid, 0) + n
    out.first_token |= report.first_token
    out.finished += finished
