"""Capacity planning: how many requests fit at once in a deployment's KV budget under each
KV layout, and the latency the cost model predicts at that concurrency.

The budget is the one ``kvbench run`` gives a simulated GPU with fused attention (vLLM's rule:
device memory x utilisation, minus the rank's share of the weights, the activation peak of
vLLM's profiling forward and non-torch memory), and the KV managers are built by the same
factory, so a plan matches what the sim then runs. A request holding ``L`` tokens takes
``reserve(L)`` slots contiguously (``max_model_len``, ``L`` itself, or the next power of two)
and ``ceil(L / block_size)`` blocks paged. With a workload the plan
uses its mean demand per request: requests that fit on average, ignoring the contiguous
arena's holes (``kvbench run`` measures those).

Each tensor-parallel rank holds its share of every sequence's KV, so concurrency follows
from one rank's budget and bytes per token; data-parallel replicas multiply it.

A model whose layers keep different kinds of KV (sliding-window and global layers,
recurrent state beside attention) is planned per layer group instead, under each group
allocation policy of :mod:`kvbench.engines.kv.group_layout`: the bytes one request takes
against what its tokens and state need, and how many fit.

Offload tiers below device memory add a dimension: per tier, how many more requests' whole
KV (in paged blocks) it keeps for a replica besides those running, how many per GiB, and how
long one takes to come back over the tier's link against recomputing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbench.engines.base import BatchShape, causal_pairs
from kvbench.engines.builtin.scheduler import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    SchedulerConfig,
)
from kvbench.engines.config import EngineSettings, KVPolicy, engine_config
from kvbench.engines.kv.base import KVManager
from kvbench.engines.kv.contiguous import RESERVATIONS, ContiguousPolicy
from kvbench.engines.kv.group_layout import GROUP_POLICIES, group_layout
from kvbench.engines.kv.offload import OffloadSpec
from kvbench.engines.kv.paged import PagedPolicy
from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import DeviceSpec, Hardware
from kvbench.errors import KvbenchError
from kvbench.run.devices import kv_budget_bytes


@dataclass(frozen=True, slots=True)
class Deployment:
    preset: ModelPreset
    gpu: Hardware
    max_model_len: int
    tp: int = 1
    num_gpus: int | None = None  # tp x data-parallel replicas (default: one replica)
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    kv_memory: int | None = None  # a fixed KV budget per replica (default: what memory leaves)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.gpus % self.tp:
            raise KvbenchError(
                f"{self.gpus} GPUs do not split into tensor-parallel groups of {self.tp}"
            )
        # The check `kvbench run` makes: a degree that splits no head evenly would plan
        # fractional heads per rank.
        self.preset.check_tensor_parallel(self.tp)

    @property
    def gpus(self) -> int:
        return self.tp if self.num_gpus is None else self.num_gpus

    @property
    def replicas(self) -> int:
        return self.gpus // self.tp

    @property
    def device(self) -> DeviceSpec:
        return DeviceSpec("sim", None, self.gpu, self.tp)

    @property
    def label(self) -> str:
        replicas = f" x {self.replicas} replicas" if self.replicas > 1 else ""
        return f"{self.gpus}x {self.gpu.name}, TP{self.tp}{replicas}"

    def kv_budget_bytes(self) -> int:
        """KV bytes of one replica, over its ranks."""
        return kv_budget_bytes(
            self.device, self.preset, kv_memory=self.kv_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
        )

    def kv_manager(self, policy: KVPolicy) -> KVManager:
        """``policy``'s KV manager over one replica's budget, as ``kvbench run`` builds it."""
        settings = EngineSettings(
            preset=self.preset, device=self.device, kv_bytes=self.kv_budget_bytes(),
            block_size=DEFAULT_BLOCK_SIZE, prefix_caching=False,
            scheduler=SchedulerConfig(
                max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
            ),
        )
        config = engine_config(policy.label(), policy, settings)
        return config.section.manager(config)


@dataclass(frozen=True, slots=True)
class Demand:
    """What one request holds at its longest: ``prompt`` + ``n`` x ``output`` tokens (paged
    samples share the prompt's blocks; contiguous ones each reserve an extent)."""

    prompt: int
    output: int = 0
    n: int = 1

    @property
    def tokens(self) -> int:
        return self.prompt + self.output


@dataclass(frozen=True, slots=True)
class CapacityRow:
    policy: str  # "contiguous/<reservation>" or "paged/bs<N>"
    held_tokens: float  # tokens one request holds at its longest (mean over the demand)
    reserved_tokens: float  # KV slots one request takes then (mean over the demand)
    max_concurrent: int  # per replica
    replicas: int
    kv_bytes_per_token: int  # over a replica's ranks (replicated KV heads count per rank)
    kv_bytes_per_token_per_rank: int
    kv_budget_bytes: int  # per replica
    kv_budget_bytes_per_rank: int
    running: int  # min(max_concurrent, max_num_seqs): what the scheduler runs at once
    decode_step_s: float  # one decode step of `running` sequences = TPOT at that load
    prefill_s: float  # one mean prompt alone, in chunks of max_num_batched_tokens

    @property
    def total_concurrent(self) -> int:
        return self.max_concurrent * self.replicas

    @property
    def held_fraction(self) -> float:
        """Slots holding tokens over slots reserved, at the requests' longest."""
        return self.held_tokens / self.reserved_tokens


def policies(block_sizes: Sequence[int]) -> list[KVPolicy]:
    """Every contiguous reservation policy, then paged at each block size."""
    return [ContiguousPolicy(reservation=r) for r in RESERVATIONS] + [
        PagedPolicy(block_size=bs) for bs in block_sizes
    ]


def reserved_slots(kv: KVManager, demand: Demand) -> int:
    """KV slots one request of ``demand`` takes in ``kv`` at its longest."""
    return kv.held_tokens(demand.prompt, demand.output, demand.n)


def plan(dep: Deployment, sections: Sequence[KVPolicy],
         demands: Sequence[Demand]) -> list[CapacityRow]:
    """One row per policy for requests like ``demands`` (each must fit max_model_len)."""
    _check_demands(dep, demands)
    budget = dep.kv_budget_bytes()
    bpt_rank = dep.preset.kv_bytes_per_token_per_rank(dep.tp)
    held = sum(d.prompt + d.n * d.output for d in demands) / len(demands)
    cost = CostModel(dep.preset, dep.gpu, dep.tp)
    ctx = sum(d.tokens for d in demands) // len(demands)
    prompt = sum(d.prompt for d in demands) // len(demands)
    rows = []
    for section in sections:
        kv = dep.kv_manager(section)
        reserved = sum(reserved_slots(kv, d) for d in demands) / len(demands)
        fits = int(kv.capacity_tokens // reserved)
        running = min(fits, dep.max_num_seqs)
        rows.append(CapacityRow(
            policy=section.label(), held_tokens=held, reserved_tokens=reserved,
            max_concurrent=fits,
            replicas=dep.replicas, kv_bytes_per_token=bpt_rank * dep.tp,
            kv_bytes_per_token_per_rank=bpt_rank, kv_budget_bytes=budget,
            kv_budget_bytes_per_rank=budget // dep.tp, running=running,
            decode_step_s=decode_step_s(cost, running, ctx),
            prefill_s=prefill_s(cost, prompt, dep.max_num_batched_tokens),
        ))
    return rows


@dataclass(frozen=True, slots=True)
class GroupRow:
    """One group allocation policy of a heterogeneous model, per replica; bytes on one rank,
    means over the demand."""

    policy: str  # "<policy>/bs<attention block tokens>"
    request_bytes: float  # what one request takes at its longest
    needed_bytes: float  # what its tokens and state need, unpaged and unpadded
    padding_layers: int  # empty layer slots the layout pays for
    max_concurrent: int
    replicas: int
    kv_budget_bytes_per_rank: int

    @property
    def total_concurrent(self) -> int:
        return self.max_concurrent * self.replicas

    @property
    def waste_fraction(self) -> float:
        """Of what a request takes, the share no token or state fills."""
        return 1 - self.needed_bytes / self.request_bytes


def plan_groups(dep: Deployment, block_sizes: Sequence[int],
                demands: Sequence[Demand]) -> tuple[list[GroupRow], list[str]]:
    """A row per group policy and block size for requests like ``demands``, and notes on
    the policies that cannot hold the model. Parallel samples each take their own pages."""
    _check_demands(dep, demands)
    budget = dep.kv_budget_bytes() // dep.tp
    p, tp = dep.preset, dep.tp
    needed = sum(d.n * p.kv_bytes_per_rank(d.tokens, tp) for d in demands) / len(demands)
    rows, notes = [], []
    for policy in GROUP_POLICIES:
        for bs in block_sizes:
            try:
                layout = group_layout(p, policy, bs, tp)
            except KvbenchError as exc:
                notes.append(f"{policy}: {exc}")
                break
            request = sum(d.n * layout.request_bytes(d.tokens) for d in demands) / len(demands)
            rows.append(GroupRow(
                policy=layout.label, request_bytes=request, needed_bytes=needed,
                padding_layers=layout.padding_tensors, max_concurrent=int(budget // request),
                replicas=dep.replicas, kv_budget_bytes_per_rank=budget,
            ))
    return rows, notes


def _check_demands(dep: Deployment, demands: Sequence[Demand]) -> None:
    if not demands:
        raise KvbenchError("no request fits max_model_len: nothing to plan for")
    too_long = [d for d in demands if d.tokens > dep.max_model_len]
    if too_long:
        raise KvbenchError(
            f"{len(too_long)} requests exceed max_model_len {dep.max_model_len} "
            f"(longest {max(d.tokens for d in too_long)} tokens)"
        )


@dataclass(frozen=True, slots=True)
class TierRow:
    """One offload tier under a replica, for requests of a demand in blocks of ``block_size``."""

    kind: str
    block_size: int
    capacity_bytes: int  # over the replica's ranks
    link: str
    request_bytes: float  # one request's KV at its longest, in its paged blocks (mean)
    sessions: int  # requests' KV the tier keeps besides those running
    load_s: float  # one request's KV back over the link, each rank its share
    recompute_s: float  # prefilling its tokens again instead, alone

    @property
    def sessions_per_gib(self) -> float:
        return 2**30 / self.request_bytes


def plan_tiers(dep: Deployment, offload: OffloadSpec, demands: Sequence[Demand],
               block_size: int) -> list[TierRow]:
    """Per tier of ``offload``: the requests like ``demands`` whose KV it keeps."""
    bpt = dep.preset.kv_bytes_per_token_per_rank(dep.tp) * dep.tp
    kv = dep.kv_manager(PagedPolicy(block_size=block_size))
    request = sum(reserved_slots(kv, d) for d in demands) / len(demands) * bpt
    held = round(sum(d.prompt + d.n * d.output for d in demands) / len(demands))
    recompute = prefill_s(CostModel(dep.preset, dep.gpu, dep.tp), held,
                          dep.max_num_batched_tokens)
    rows = []
    for tier in offload.tiers:
        link = tier.link_for(dep.gpu.name)
        rows.append(TierRow(
            kind=tier.kind, block_size=block_size, capacity_bytes=tier.size_bytes,
            link=link.name, request_bytes=request, sessions=int(tier.size_bytes // request),
            load_s=request / (dep.tp * link.load_bytes_per_s), recompute_s=recompute))
    return rows


def decode_step_s(cost: CostModel, num_seqs: int, context: int) -> float:
    """One decode step of ``num_seqs`` sequences, each attending over ``context`` tokens."""
    return cost.step_time_s(BatchShape(
        num_seqs=num_seqs, decode_tokens=num_seqs, context_tokens=num_seqs * context,
        attn_pairs=num_seqs * context, decode_pairs=num_seqs * context,
    ))


def prefill_s(cost: CostModel, prompt: int, chunk: int) -> float:
    """A ``prompt``-token prefill running alone, ``chunk`` tokens per step (chunked prefill)."""
    total, start = 0.0, 0
    while start < prompt:
        n = min(chunk, prompt - start)
        total += cost.step_time_s(BatchShape(
            num_seqs=1, prefill_tokens=n, context_tokens=start + n,
            attn_pairs=causal_pairs(start, n),
        ))
        start += n
    return total


def concurrency_curve(dep: Deployment, section: KVPolicy,
                      lengths: Sequence[int]) -> list[int]:
    """Max concurrent requests (per replica) holding each of ``lengths`` tokens."""
    kv = dep.kv_manager(section)
    return [int(kv.capacity_tokens // reserved_slots(kv, Demand(n))) for n in lengths]


def write_concurrency_plot(dep: Deployment, sections: Sequence[KVPolicy], path: Path,
                           mark: int | None = None) -> Path:
    """Max concurrent requests vs tokens per request, one line per policy, as a PNG;
    ``mark`` draws a line at one request length."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from kvbench.report.plots import save_png
    from kvbench.units import format_bytes

    lengths = sorted({int(x) for x in np.geomspace(64, dep.max_model_len, 400)})
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for section in sections:
        curve = concurrency_curve(dep, section, lengths)
        ax.step(lengths, curve, where="post", linewidth=1.6, label=section.label())
    budget = dep.kv_budget_bytes()
    if mark is not None:
        ax.axvline(mark, color="grey", linestyle=":", linewidth=1.2,
                   label=f"{mark} tokens/request")
    ax.set_xscale("log", base=2)
    ticks = [1 << k for k in range(6, dep.max_model_len.bit_length())]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_yscale("log")
    ax.set_xlabel("tokens per request at its longest (prompt + output)")
    ax.set_ylabel("max concurrent requests per replica (requests)")
    ax.set_title(
        f"{dep.preset.name} on {dep.label}: requests that fit in the KV cache\n"
        f"KV budget {format_bytes(budget // dep.tp)} per rank "
        f"({format_bytes(dep.preset.kv_bytes_per_token_per_rank(dep.tp))}/token/rank), "
        f"max_model_len {dep.max_model_len}, gpu_memory_utilization "
        f"{dep.gpu_memory_utilization}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="KV layout / reservation", fontsize=9)
    return save_png(fig, path)


# --- grids (``kvbench capacity --grid FIELD=V1,V2 ...``) ---------------------------------

# The fields a capacity grid takes, and the flag each one stands for.
GRID_FIELDS: dict[str, str] = {
    "model": "--model", "gpu": "--gpu", "tp": "--tp", "num_gpus": "--num-gpus",
    "replicas": "TP groups (num_gpus = replicas x tp)", "policy": "one KV layout per point",
    "block_size": "--block-size", "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "kv_memory": "a fixed KV budget per replica instead of the one device memory leaves",
    "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
    "seq_len": "--seq-len",
}
_GRID_ALIASES = {"engine": "policy", "device": "gpu", "preset": "model"}


@dataclass(frozen=True, slots=True)
class GridAxis:
    field: str  # a GRID_FIELDS key
    name: str  # as the user wrote it
    texts: tuple[str, ...]
    values: tuple[object, ...]


def parse_grid_axis(text: str) -> GridAxis:
    """``FIELD=V1,V2,...`` over a capacity field, each value checked."""
    from kvbench.tools.grid import split_axis

    name, texts = split_axis(text)
    key = name.replace("-", "_")
    field = _GRID_ALIASES.get(key, key)
    if field not in GRID_FIELDS:
        raise KvbenchError(f"--grid {name}: capacity has no such field; fields: "
                           f"{', '.join(GRID_FIELDS)} (engine = policy, device = gpu)")
    return GridAxis(field, name, texts, tuple(_grid_value(field, name, v) for v in texts))


def _grid_value(field: str, name: str, text: str) -> object:
    from kvbench.engines.model.hf_config import model_preset
    from kvbench.engines.sim.hardware import get_gpu
    from kvbench.units import parse_bytes

    try:
        if field == "model":
            return model_preset(text)
        if field == "gpu":
            return get_gpu(text)
        if field == "policy":
            return grid_policy(text)
        if field == "gpu_memory_utilization":
            value = float(text)
            if not 0 < value <= 1:
                raise ValueError("a fraction in (0, 1]")
            return value
        value = parse_bytes(text) if field == "kv_memory" else int(text)
        if value < 1:
            raise ValueError("a positive number")
        return value
    except (KvbenchError, ValueError, KeyError) as exc:
        raise KvbenchError(f"--grid {name}={text}: not a valid {field} ({exc})") from None


def grid_policy(text: str) -> KVPolicy:
    """A KV layout by the name ``kvbench capacity`` prints (``paged/bs16``,
    ``contiguous/request``) or a built-in engine's (``paged``, ``contiguous-pow2``)."""
    from kvbench.engines.registry import NAMED_ENGINES

    kind, _, rest = text.partition("/")
    if kind == "paged" and rest.startswith("bs") and rest[2:].isdigit():
        return PagedPolicy(block_size=int(rest[2:]))
    if kind == "contiguous" and rest in RESERVATIONS:
        return ContiguousPolicy(reservation=rest)
    named = NAMED_ENGINES.get(text)
    if isinstance(named, KVPolicy):
        return named
    names = [n for n, s in NAMED_ENGINES.items() if isinstance(s, KVPolicy)]
    raise KvbenchError(f"unknown KV layout {text!r}: use paged/bs<N>, contiguous/"
                       f"{{{','.join(RESERVATIONS)}}} or a built-in engine ({', '.join(names)})")


def grid_deployment(values: dict[str, object]) -> tuple[Deployment, list[KVPolicy]]:
    """The deployment and KV layouts of one grid point: ``values`` holds a value for every
    field (``None`` where unset: max_model_len, num_gpus, replicas, kv_memory, policy),
    ``block_size`` a list of block sizes where no policy is set."""
    preset = values["model"]
    assert isinstance(preset, ModelPreset)
    tp = int(values["tp"])  # type: ignore[call-overload]
    limit = values["max_model_len"] or preset.max_position
    if int(limit) > preset.max_position:  # type: ignore[call-overload]
        raise KvbenchError(f"max_model_len {limit} exceeds {preset.name}'s context of "
                           f"{preset.max_position}")
    gpus = values["num_gpus"]
    if values["replicas"] is not None:
        if gpus is not None:
            raise KvbenchError("give num_gpus or replicas, not both")
        gpus = int(values["replicas"]) * tp  # type: ignore[call-overload]
    dep = Deployment(
        preset, values["gpu"], int(limit), tp=tp,  # type: ignore[arg-type,call-overload]
        num_gpus=gpus,  # type: ignore[arg-type]
        gpu_memory_utilization=float(values["gpu_memory_utilization"]),  # type: ignore[arg-type]
        max_num_batched_tokens=int(values["max_num_batched_tokens"]),  # type: ignore[call-overload]
        max_num_seqs=int(values["max_num_seqs"]),  # type: ignore[call-overload]
        kv_memory=values["kv_memory"],  # type: ignore[arg-type]
    )
    sizes = values["block_size"]
    policy = values["policy"]
    if policy is None:
        return dep, policies(sizes if isinstance(sizes, list) else [int(sizes)])  # type: ignore[call-overload]
    assert isinstance(policy, KVPolicy)
    if isinstance(policy, PagedPolicy) and policy.block_size is None:
        # A built-in engine's paged layout, at the point's (or the first) block size.
        size = sizes[0] if isinstance(sizes, list) else sizes
        policy = policy.model_copy(update={"block_size": int(size)})  # type: ignore[call-overload]
    return dep, [policy]
