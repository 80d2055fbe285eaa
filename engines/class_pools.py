"""Real KV memory for a pool of several page classes (:mod:`kvbench.engines.kv.modal`).

Each class has its own cache tensor ``[num_layers, 2, num_slots, kv_heads, head_dim]`` in its
storage dtype; a quantised class also has float32 scales ``[num_layers, 2, num_slots // group,
kv_heads]`` and every class a ``slot_positions`` array (the position each slot holds). A step
stores each token's K/V into its class's cache (quantising there) and attends every query to
each class's keys with explicit positions, then merges the classes' outputs by their
log-sum-exp: exactly attention over all the sequence's keys, each read at its class's
precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvbench.engines.kv.modal import ClassTables, PoolClass
from kvbench.engines.presets import ModelPreset
from kvbench.engines.torch_device import TORCH_DTYPES, zeros
from kvbench.kernels.backend import KernelBackend

STORAGE = {**TORCH_DTYPES, "int8": torch.int8}
if hasattr(torch, "float8_e4m3fn"):
    STORAGE["fp8_e4m3"] = torch.float8_e4m3fn


def storage_dtype(name: str) -> torch.dtype:
    from kvbench.errors import KvbenchError

    try:
        return STORAGE[name]
    except KeyError:
        raise KvbenchError(
            f"KV dtype {name} is not supported by this torch build ({torch.__version__})"
        ) from None


@dataclass(slots=True)
class _ClassCache:
    spec: PoolClass
    kv: Tensor  # [L, 2, S, Hkv, D]
    scales: Tensor | None  # [L, 2, S // group, Hkv]
    positions: Tensor  # [S] int32


@dataclass(slots=True)
class _ClassStep:
    """One class's part of a step: the batch rows stored into it and where, its tables."""

    cache: _ClassCache
    rows: Tensor
    slots: Tensor
    tables: Tensor
    context_lens: Tensor
    plan: Any


class ClassPools:
    """The caches of every class of a modal pool, and the step being computed."""

    def __init__(self, preset: ModelPreset, classes: tuple[PoolClass, ...],
                 device: torch.device) -> None:
        p = preset
        self.caches: list[_ClassCache] = []
        for c in classes:
            dtype = storage_dtype(c.dtype)
            kv = zeros((p.num_layers, 2, c.num_slots, p.num_kv_heads, p.head_dim), dtype,
                       device, f"{c.name} KV pool of {c.num_slots} {c.dtype} tokens")
            scales = None
            if c.quantised:
                scales = torch.zeros((p.num_layers, 2, c.num_slots // c.scale_group,
                                      p.num_kv_heads), dtype=torch.float32, device=device)
            positions = torch.zeros(c.num_slots, dtype=torch.int32, device=device)
            self.caches.append(_ClassCache(c, kv, scales, positions))
        self._steps: list[_ClassStep] = []
        self._query_positions: Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the pool holds (caches, scales, slot positions)."""
        return sum(c.kv.nbytes + (0 if c.scales is None else c.scales.nbytes)
                   + c.positions.nbytes for c in self.caches)

    def kv_nbytes(self) -> dict[str, int]:
        """Per class: bytes of its cache and scales (the KV memory proper)."""
        return {c.spec.name: c.kv.nbytes + (0 if c.scales is None else c.scales.nbytes)
                for c in self.caches}

    def begin(self, kernels: KernelBackend, layout: ClassTables, slots: np.ndarray,
              positions: Tensor, cu_seqlens_q: Tensor, num_heads: int) -> None:
        """Prepare a step: split its tokens by class, record their positions, plan."""
        device = positions.device
        self._query_positions = positions.to(torch.int32)
        self._steps = []
        for k, cache in enumerate(self.caches):
            c = cache.spec
            mine = (slots >= c.base) & (slots < c.base + c.num_slots)
            rows = torch.from_numpy(np.flatnonzero(mine)).to(device)
            local = torch.from_numpy(slots[mine] - c.base).to(device, torch.int64)
            cache.positions[local] = self._query_positions[rows]
            tables, lens = layout.tables[k], layout.context_lens[k]
            plan = None
            if kernels.plan_paged is not None:
                plan = kernels.plan_paged(tables, lens, cu_seqlens_q, c.page_tokens,
                                          cache.kv[0, 0], cache.kv[0, 1], num_heads,
                                          positions=True)
            self._steps.append(_ClassStep(cache, rows, local, tables, lens, plan))
        self._cu = cu_seqlens_q

    def __getitem__(self, layer: int) -> _Layer:
        return _Layer(self, layer)


@dataclass(slots=True)
class _Layer:
    pools: ClassPools
    layer: int

    def store_attend(self, kernels: KernelBackend, q: Tensor, k: Tensor, v: Tensor,
                     scale: float) -> Tensor:
        """Store this step's K/V class by class, then attention over every class merged."""
        pools, i = self.pools, self.layer
        qpos = pools._query_positions
        out: Tensor | None = None
        lse: Tensor | None = None
        for step in pools._steps:
            cache = step.cache
            kc, vc = cache.kv[i, 0], cache.kv[i, 1]
            ks = vs = None
            if cache.scales is not None:
                ks, vs = cache.scales[i, 0], cache.scales[i, 1]
            if step.rows.numel():
                key, value = k[step.rows], v[step.rows]
                if ks is None and kc.dtype != key.dtype:
                    key, value = key.to(kc.dtype), value.to(vc.dtype)
                kernels.store_kv(kc, vc, key, value, step.slots, k_scale=ks, v_scale=vs)
            o, part = kernels.paged_attention(
                q, kc, vc, step.tables, step.context_lens, pools._cu,
                cache.spec.page_tokens, scale, k_scale=ks, v_scale=vs,
                slot_positions=cache.positions, query_positions=qpos, return_lse=True,
                plan=step.plan,
            )
            if out is None:
                out, lse = o, part
            else:
                assert lse is not None
                out, lse = kernels.merge_attention(out, lse, o, part, return_lse=True)
        assert out is not None
        return out
