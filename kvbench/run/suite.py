"""Suite files (TOML): which workload, model, device and engines a run uses.

Every field has a default, so ``kvbench run`` flags can fill or override any of them.
"""

from __future__ import annotations

import importlib.resources
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvbench.engines.builtin.scheduler import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from kvbench.engines.cluster.engine import ClusterSection
from kvbench.engines.config import EngineSection
from kvbench.engines.kv.offload import Preemption
from kvbench.engines.registry import NAMED_ENGINES, AnyEngineSection
from kvbench.engines.sim.activations import AttentionImpl
from kvbench.engines.sim.device_memory import KVAllocation
from kvbench.errors import InputFileError, KvbenchError
from kvbench.fileio import read_text
from kvbench.results.paths import name_length_problem, path_component_problem, path_length_problem
from kvbench.results.slo import SLO
from kvbench.units import did_you_mean
from kvbench.workloads.textstream import too_deep
from kvbench.workloads.validation import validation_message

DEFAULT_SUITE = "default"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkloadSection(_Strict):
    """At most one source: a generator ``preset``, a workload ``file`` (.jsonl), a ``trace``
    of kind azure | mooncake | sharegpt at ``path``, or a generator ``spec`` inline (none:
    the ``mixed-text`` preset)."""

    preset: str | None = None
    file: str | None = None
    trace: Literal["azure", "azure-lmm", "mooncake", "sharegpt"] | None = None
    path: str | None = None
    # azure-lmm: every image's token rule and size, RULE[:HxW] (default llava-1.5).
    image_rule: str | None = None
    # A full generator spec inline (`[workload.spec]`: classes, arrival, images, ...).
    spec: dict[str, Any] | None = None
    num_requests: int | None = Field(default=None, ge=1)
    # numpy's generators take no negative seed.
    seed: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadSection:
        sources = [x for x in (self.preset, self.file, self.trace, self.spec) if x is not None]
        if len(sources) > 1:
            raise ValueError("give only one of preset, file, trace or spec")
        if self.trace is not None and self.path is None:
            raise ValueError("a trace needs a path")
        return self


class ModelSection(_Strict):
    preset: str = "tiny"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    weights: str | None = None


class RunSection(_Strict):
    device: str = "auto"
    clock: Literal["auto", "wall", "virtual"] = "auto"
    kv_memory: str | None = None
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1)
    max_num_seqs: int = Field(default=DEFAULT_MAX_NUM_SEQS, ge=1)
    max_num_batched_tokens: int = Field(default=DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    chunked_prefill: bool = True
    prefix_caching: bool = True
    # Tiers below device memory for the paged engines, as `cpu:64GiB,disk:1TiB`
    # (kvbench.engines.kv.offload); an engine's own `offload` table wins.
    kv_offload: str | None = None
    # What a preempted sequence's KV becomes in the paged engines: "recompute", or "swap"
    # (copied to the first offload tier); an engine's own `preemption` wins.
    kv_preemption: Preemption | None = None
    engines: list[str] = Field(default_factory=lambda: ["paged", "contiguous"])
    slo: SLO | None = None
    # Intra-op threads of real compute on a CPU (None: torch's default). Small models gain
    # little from threads, and spinning OpenMP threads on a busy machine slow them ~10x.
    cpu_threads: int | None = Field(default=None, ge=1)
    # Kernels of real compute: auto = Triton on CUDA when installed, the native C decode
    # kernel on the CPU where it builds, else the torch reference.
    attention: Literal["auto", "native", "reference", "triton"] = "auto"
    # Most requests in flight at once (client-side, as vllm bench serve's): None, no limit.
    max_concurrency: int | None = Field(default=None, ge=1)
    # Re-time the workload's arrivals at this many requests/s (inf: all at once), gamma gaps
    # of shape `burstiness` (1: Poisson), as vllm bench serve's --request-rate/--burstiness.
    request_rate: float | None = Field(default=None, gt=0)
    burstiness: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    # A simulated device's memory model (kvbench.engines.sim.device_memory): the attention
    # kernel whose workspace it counts, how the KV cache takes device memory, and the
    # seeds' "sliding window not disabled" as extra KV per running sequence.
    attention_impl: AttentionImpl = "fused"
    kv_allocation: KVAllocation = "preallocated"
    extra_kv_window_tokens: int = Field(default=0, ge=0)
    # Simulated engines under the virtual clock take runs of decode-only steps between
    # events in one go; records are identical either way (false: step by step, to check).
    fast_forward: bool = True
    # Real compute: compare the outputs of every engine whose KV policy stores tokens below
    # the model's dtype with a full-precision reference pass (kvbench.run.quality).
    quality_check: bool = True
    # Wall clock: every engine runs in a fresh process (as asv runs each benchmark), so
    # none inherits another's memory, allocator state, thread pools or caches; true runs
    # them all in this process (for debugging).
    in_process: bool = False
    # Rounds of every engine (interleaved orders on the wall clock); --repeat overrides.
    repeat: int = Field(default=1, ge=1)

    @field_validator("engines")
    @classmethod
    def _file_names(cls, names: list[str]) -> list[str]:
        # Each engine names its record file: refused now, not when the record is written.
        for name in names:
            problem = path_component_problem(name, "engine")
            if problem is not None:
                raise ValueError(problem)
        return names


class Suite(_Strict):
    name: str
    description: str = ""
    workload: WorkloadSection = Field(default_factory=lambda: WorkloadSection(preset="mixed-text"))
    model: ModelSection = Field(default_factory=ModelSection)
    run: RunSection = Field(default_factory=RunSection)
    engines: dict[str, AnyEngineSection] = Field(default_factory=dict)
    # Replicas behind a router, or disaggregated prefill/decode (kvbench.engines.cluster.engine).
    cluster: ClusterSection = Field(default_factory=ClusterSection)

    @field_validator("name")
    @classmethod
    def _short_name(cls, name: str) -> str:
        # The name starts output folders' names (runs/<suite>-<time>, baselines/…/<suite>).
        problem = name_length_problem(name, "suite")
        if problem is not None:
            raise ValueError(problem)
        return name

    def engine(self, name: str) -> EngineSection:
        if name in self.engines:
            return self.engines[name]
        if name in NAMED_ENGINES:
            return NAMED_ENGINES[name]
        valid = sorted({*self.engines, *NAMED_ENGINES})
        raise KvbenchError(
            f"unknown engine {name!r}; {did_you_mean(name, valid)}valid engines: "
            f"{', '.join(valid)}"
        )


def suite_names() -> list[str]:
    root = importlib.resources.files("kvbench.suites")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_suite(ref: str | None) -> tuple[Suite, Path | None]:
    """A suite by file path or by name (``benchmarks/suites/<name>.toml``); None = default.

    Returns the suite and the folder relative paths in it resolve against: the suite file's.
    """
    ref = ref or DEFAULT_SUITE
    if (problem := path_length_problem(ref, "suite")) is not None:
        raise KvbenchError(problem)
    path = Path(ref)
    if path.suffix == ".toml" or path.is_dir():
        text, base = read_text(path, "suite (.toml)"), path.parent
    else:
        res = importlib.resources.files("kvbench.suites") / f"{ref}.toml"
        if not res.is_file():
            raise KvbenchError(
                f"no suite {ref!r}: {did_you_mean(ref, suite_names())}give a .toml file path "
                f"or one of: {', '.join(suite_names())}"
            )
        path = Path(str(res))
        text, base = res.read_text(encoding="utf-8"), path.parent
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputFileError(path, f"invalid TOML: {exc}") from None
    except RecursionError:
        raise too_deep(path, "suite file") from None
    if not data:
        raise InputFileError(
            path, "the suite file is empty; give at least [run] engines = [...] or name a "
            f"built-in suite ({', '.join(suite_names())})"
        )
    data.setdefault("name", path.stem)
    try:
        return Suite.model_validate(data), base
    except ValidationError as exc:
        raise InputFileError(path, f"invalid suite: {validation_message(exc)}") from None
