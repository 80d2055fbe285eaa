"""Engine configuration, resolved once: a suite's engine section plus the run's settings
become one :class:`EngineConfig` that the engine reads and nothing re-derives.

An engine section is a pydantic model per engine kind (each KV policy of the built-in
engine, and external engines such as vLLM), a member of the discriminated union the
registry builds, so suite files validate per kind. Fields left ``None`` inherit the run's
value (block size, prefix caching) when the section is resolved.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field

from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.kv.offload import OffloadSpec, Preemption
from kvbench.engines.kv.spec import Footprint, KVSpec, kv_bytes_per_token, never_runs
from kvbench.engines.model.hf_config import SUPPORTED_ARCHITECTURES
from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.sim.device_memory import MemoryOptions
from kvbench.engines.sim.hardware import DeviceSpec
from kvbench.errors import KvbenchError
from kvbench.workloads.model import Request

if TYPE_CHECKING:
    from kvbench.engines.kv.base import KVManager


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The run's settings every engine section starts from (suite ``[run]`` and flags)."""

    preset: ModelPreset
    device: DeviceSpec
    kv_bytes: int
    block_size: int
    prefix_caching: bool
    scheduler: SchedulerConfig
    weights: str | None = None
    seed: int = 0
    attention: str = "auto"
    # How a simulated device's memory is modelled (real devices are measured instead).
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    # Offload tiers for the paged engines that set none (kvbench.engines.kv.offload).
    offload: OffloadSpec | None = None
    # What a preempted sequence's KV becomes in the paged engines that set none.
    preemption: Preemption | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine is built from. ``kv`` is its KV pool's page class and
    ``num_pages`` how many pages the budget ``kv_bytes`` holds."""

    name: str
    section: EngineSection
    preset: ModelPreset
    device: DeviceSpec
    kv_bytes: int
    kv: KVSpec
    num_pages: int
    scheduler: SchedulerConfig
    prefix_caching: bool
    weights: str | None
    seed: int
    attention: str
    memory: MemoryOptions

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.kv.page_tokens


@dataclass(frozen=True, slots=True)
class ServerProcess:
    """Where a served engine's memory can be read on this machine: the server's process
    (and its children) and the index of its GPU; None where unknown or not local."""

    pid: int | None = None
    gpu_index: int | None = None


class EngineSection(BaseModel):
    """Base of every engine kind's section. ``summary`` is its one line in `kvbench list`;
    ``realtime`` kinds drive a live system, so their runs need the wall clock. The registry
    (:func:`kvbench.engines.registry.build_engine`) builds the engine a section describes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    summary: ClassVar[str]
    realtime: ClassVar[bool] = False
    # Whether the kind allocates KV per layer group (models mixing kinds of KV run on it).
    allocates_groups: ClassVar[bool] = False

    def resolved(self, settings: EngineSettings) -> Self:
        """This section with every inherited field filled from ``settings``."""
        return self

    def page_tokens(self) -> int:
        """Token slots per page of the KV pool (1: a slot-granular arena)."""
        return 1

    @property
    def prefix_caching_enabled(self) -> bool:
        return False

    def label(self) -> str:
        """A short name of the kind with its distinguishing options (tables, plots)."""
        return self.kind

    def held_back_bytes(self, kv_bytes: int) -> int:
        """Bytes of the KV budget ``kv_bytes`` this kind keeps out of its pool."""
        return 0

    def block_multiple(self, device: DeviceSpec) -> int:
        """What the run's block size must be a multiple of for this kind on ``device``."""
        return 1

    def check(self, config: EngineConfig) -> list[str]:
        """Fail before any work when this kind cannot run ``config``; return warnings about
        what it will run only in part (the run goes on)."""
        return []

    def server(self) -> ServerProcess | None:
        """The server process whose memory telemetry should read instead of this one's
        (None: the engine runs in this process)."""
        return None

    @abstractmethod
    def admission(self, config: EngineConfig) -> Callable[[Request], str | None]:
        """The rule saying why a request can never run on this engine (or None)."""


class KVPolicy(EngineSection):
    """A KV policy of the built-in engine: its manager does the bookkeeping, the built-in
    scheduler and executors do the rest. ``reserved_memory`` holds that fraction of the KV
    budget back from the pool (the reports' headroom, P6): the pool, and every figure of its
    capacity, is the rest."""

    reserved_memory: float = Field(default=0.0, ge=0.0, lt=1.0)

    def held_back_bytes(self, kv_bytes: int) -> int:
        return int(kv_bytes * self.reserved_memory)

    def full_precision(self) -> KVPolicy:
        """This policy with every token's KV stored at the model's dtype: the reference of
        its output agreement. A policy that stores none below it is its own."""
        return self

    @abstractmethod
    def manager(self, config: EngineConfig) -> KVManager:
        """A fresh KV manager over ``config``'s pool."""

    @abstractmethod
    def footprint(self, config: EngineConfig, request: Request) -> Footprint:
        """What ``request`` needs in an empty pool of ``config`` (the manager's answer,
        without building one)."""

    def admission(self, config: EngineConfig) -> Callable[[Request], str | None]:
        sched = config.scheduler

        def rejection(request: Request) -> str | None:
            return never_runs(request, sched.max_model_len, self.footprint(config, request),
                              config.kv.bytes_per_token, sched.max_num_seqs)

        return rejection


class Paging(EngineSection):
    """A section whose KV pool is paged: blocks of ``block_size`` tokens and prefix caching,
    the run's unless the section sets them."""

    block_size: int | None = Field(default=None, ge=1)
    prefix_caching: bool | None = None

    def resolved(self, settings: EngineSettings) -> Self:
        return self.model_copy(update={
            "block_size": self.block_size or settings.block_size,
            "prefix_caching": (
                settings.prefix_caching if self.prefix_caching is None else self.prefix_caching
            ),
        })

    def page_tokens(self) -> int:
        assert self.block_size is not None, "resolve the section first"
        return self.block_size

    @property
    def prefix_caching_enabled(self) -> bool:
        return bool(self.prefix_caching)


def _check_model(preset: ModelPreset, device: DeviceSpec, section: EngineSection) -> None:
    """Refuse a model the engine would misrepresent: mixed layer groups in one pool, or
    real compute of an architecture the built-in model does not compute."""
    mixed = preset.mixed_kv()
    if mixed and not section.allocates_groups:
        raise KvbenchError(f"{mixed}; run it with the hybrid KV policy, which allocates KV "
                           "per layer group (--engines hybrid), or plan its groups with "
                           "kvbench capacity")
    if device.kind != "sim" and preset.hf_architecture not in SUPPORTED_ARCHITECTURES:
        raise KvbenchError(
            f"{preset.name} ({preset.hf_architecture}) runs on simulated devices only: the "
            f"built-in model computes {', '.join(SUPPORTED_ARCHITECTURES)}; use --device "
            "sim:GPU"
        )


def engine_config(name: str, section: EngineSection, settings: EngineSettings) -> EngineConfig:
    """Resolve ``section`` against the run's ``settings``: the one place an engine's page
    size, page count and prefix caching are decided."""
    section = section.resolved(settings)
    preset, device = settings.preset, settings.device
    _check_model(preset, device, section)
    kv = KVSpec(section.page_tokens(), kv_bytes_per_token(preset, device.tp), preset.dtype)
    held_back = section.held_back_bytes(settings.kv_bytes)
    num_pages = (settings.kv_bytes - held_back) // kv.page_bytes
    if num_pages < 1:
        kept = f" after holding back {held_back} bytes" if held_back else ""
        raise KvbenchError(
            f"KV budget {settings.kv_bytes} bytes holds no {kv.page_tokens}-token page of "
            f"{kv.page_bytes} bytes{kept}; raise --kv-memory to at least "
            f"{kv.page_bytes + held_back}"
        )
    return EngineConfig(
        name=name, section=section, preset=preset, device=device, kv_bytes=settings.kv_bytes,
        kv=kv, num_pages=num_pages, scheduler=settings.scheduler,
        prefix_caching=section.prefix_caching_enabled, weights=settings.weights,
        seed=settings.seed, attention=settings.attention, memory=settings.memory,
    )

