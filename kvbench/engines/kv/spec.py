"""What one page class of a KV pool holds (as vLLM's ``KVCacheSpec`` states it), the one
bytes-per-token formula, and the one rule for requests that can never run.

A KV pool is a flat array of token slots; a page class groups them into pages of
``page_tokens`` slots (a paged block; 1 for a contiguous arena, whose extents have any
length). Executors, kernels and capacity planning read these facts, never a policy's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbench.engines.model.presets import ModelPreset
from kvbench.units import format_bytes
from kvbench.workloads.model import Request

Holds = Literal["all", "text", "image", "audio"]


def kv_bytes_per_token(preset: ModelPreset, tp: int = 1) -> int:
    """KV bytes of one token summed over ``tp`` tensor-parallel ranks: each rank holds its
    share of the KV heads, replicated when there are fewer KV heads than ranks (so a
    replicated head counts once per rank holding it)."""
    return preset.kv_bytes_per_token_per_rank(tp) * tp


@dataclass(frozen=True, slots=True)
class KVSpec:
    """One page class: ``page_tokens`` token slots per page, ``bytes_per_token`` bytes each
    (all layers, K and V, over the tensor-parallel ranks), stored as ``dtype`` (None for a
    manager built for bookkeeping alone), holding the KV of ``holds`` tokens (all, or one
    modality)."""

    page_tokens: int
    bytes_per_token: int
    dtype: str | None
    holds: Holds = "all"

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token

    def to_json(self) -> dict[str, object]:
        return {
            "page_tokens": self.page_tokens, "bytes_per_token": self.bytes_per_token,
            "page_bytes": self.page_bytes, "dtype": self.dtype, "holds": self.holds,
        }


@dataclass(frozen=True, slots=True)
class LayerPools:
    """Where each layer of a model keeping KV per layer group finds it: ``tensors`` cache
    tensors of ``slots`` token slots each; layer ``l`` stores into tensor ``tensor_of[l]``
    at the slots of allocation group ``group_of[l]`` (the manager's ``slots`` and
    ``attention_layout`` for that group)."""

    tensors: int
    slots: int
    tensor_of: tuple[int, ...]
    group_of: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a request needs in an empty cache before it can run at all: ``tokens`` slots of
    a pool of ``capacity_tokens``; ``what`` says it in the policy's terms (e.g. "5 blocks
    of 16 tokens") and ``hint`` what else might help."""

    tokens: int
    capacity_tokens: int
    what: str
    capacity: str
    hint: str = ""


def never_runs(
    request: Request,
    max_model_len: int,
    footprint: Footprint,
    bytes_per_token: int,
    max_num_seqs: int | None = None,
) -> str | None:
    """Why ``request`` can never run, whatever else is running, or None: it is longer than
    the context, has more samples than may run at once, or needs more KV than the whole
    cache holds. Every engine applies this one rule."""
    need = request.prompt_tokens + request.output_tokens
    if need > max_model_len:
        return (
            f"request {request.id} needs {need} tokens (prompt {request.prompt_tokens} + "
            f"output {request.output_tokens}) but max_model_len is {max_model_len}; "
            f"raise --max-model-len to at least {need} or shorten the request"
        )
    if max_num_seqs is not None and request.n > max_num_seqs:
        return (
            f"request {request.id} has n={request.n} samples but max_num_seqs is "
            f"{max_num_seqs}; raise --max-num-seqs to at least {request.n}"
        )
    if footprint.tokens > footprint.capacity_tokens:
        need_bytes = format_bytes(footprint.tokens * bytes_per_token)
        return (
            f"request {request.id} needs {footprint.what} ({need_bytes}) but the KV cache "
            f"holds {footprint.capacity} "
            f"({format_bytes(footprint.capacity_tokens * bytes_per_token)}); raise "
            f"--kv-memory to at least {need_bytes}{footprint.hint}"
        )
    return None
