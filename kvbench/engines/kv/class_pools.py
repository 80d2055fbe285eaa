"""Real KV memory for a pool of several page classes (:mod:`kvbench.engines.kv.modal`).

The pages of the classes of one allocator (both classes of a shared pool; each class alone
when split) live in one byte buffer of exactly that pool's bytes, ``[num_layers, 2,
pool_bytes / (2 num_layers)]`` uint8; each class views it in its storage dtype as ``[num_layers,
2, num_slots, kv_heads, head_dim]``. Slot ``s`` of a class lies at bytes ``s x bytes_per_token /
(2 num_layers)`` of every layer's K and V plane, so a page of ``n`` buddy units at unit ``u``
takes the same bytes ``[u, u + n) x unit / (2 num_layers)`` of each plane in whichever class
holds it, and pages the allocator keeps apart never overlap. The real-compute KV memory is
then the budget's: pool bytes plus the scale tables. A page a class writes for the first
time (its first slot stored) is zeroed first, as the bytes may hold another class's codes,
which read in this class's dtype could be NaN even where attention gives them no weight. A
quantised class also has float32 scales ``[num_layers, 2, num_slots // group, kv_heads]`` and
every class a ``slot_positions`` array (the position each slot holds). A step
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

from kvbench.engines.builtin.torch_device import TORCH_DTYPES, zeros
from kvbench.engines.kv.page_classes import ClassTables, PoolClass
from kvbench.engines.model.presets import ModelPreset
from kvbench.kernels.backend import KernelBackend
from kvbench.kernels.slot_copy import SlotCopy

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
    kv: Tensor  # [L, 2, S, Hkv, D], a view of its pool's byte buffer
    scales: Tensor | None  # [L, 2, S // group, Hkv]
    positions: Tensor  # [S] int32
    shared: bool  # another class views the same bytes


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
        # One byte buffer per allocator, as large as its largest class view (in a shared
        # pool every class addresses all its units, so the views are the same size).
        sizes: dict[int, int] = {}
        for c in classes:
            sizes[c.pool] = max(sizes.get(c.pool, 0), c.num_slots * c.bytes_per_token)
        planes = 2 * p.num_layers
        self.buffers: dict[int, Tensor] = {}
        for pool, nbytes in sizes.items():
            names = "+".join(c.name for c in classes if c.pool == pool)
            self.buffers[pool] = zeros((p.num_layers, 2, nbytes // planes), torch.uint8,
                                       device, f"{names} KV pool of {nbytes} bytes")
        for c in classes:
            dtype = storage_dtype(c.dtype)
            buf = self.buffers[c.pool]
            plane = c.num_slots * c.bytes_per_token // planes
            kv = buf[:, :, :plane].view(dtype).view(
                p.num_layers, 2, c.num_slots, p.num_kv_heads, p.head_dim)
            scales = None
            if c.quantised:
                scales = torch.zeros((p.num_layers, 2, c.num_slots // c.scale_group,
                                      p.num_kv_heads), dtype=torch.float32, device=device)
            positions = torch.zeros(c.num_slots, dtype=torch.int32, device=device)
            shared = sum(1 for o in classes if o.pool == c.pool) > 1
            self.caches.append(_ClassCache(c, kv, scales, positions, shared))
        self._steps: list[_ClassStep] = []
        self._query_positions: Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the pool holds (page buffers, scales, slot positions)."""
        return sum(self.kv_nbytes().values()) + sum(c.positions.nbytes for c in self.caches)

    def kv_nbytes(self) -> dict[str, int]:
        """Per page buffer (named by the classes viewing it, ``text+vision`` when shared):
        its bytes and its classes' scales (the KV memory proper)."""
        out: dict[str, int] = {}
        for pool, buf in self.buffers.items():
            mine = [c for c in self.caches if c.spec.pool == pool]
            out["+".join(c.spec.name for c in mine)] = buf.nbytes + sum(
                0 if c.scales is None else c.scales.nbytes for c in mine)
        return out

    def copy(self, copies: list[SlotCopy]) -> None:
        """Apply copy-on-write copies (flat slots, each within one class): the slots' K/V
        codes, their scales and positions."""
        for cp in copies:
            cache = next(c for c in self.caches
                         if c.spec.base <= cp.src < c.spec.base + c.spec.num_slots)
            c = cache.spec
            src, dst, n = cp.src - c.base, cp.dst - c.base, cp.num_slots
            cache.kv[:, :, dst : dst + n] = cache.kv[:, :, src : src + n].clone()
            cache.positions[dst : dst + n] = cache.positions[src : src + n].clone()
            if cache.scales is not None:
                g = c.scale_group  # pages hold whole scale groups
                cache.scales[:, :, dst // g : (dst + n) // g] = \
                    cache.scales[:, :, src // g : (src + n) // g].clone()

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
            host = slots[mine] - c.base
            local = torch.from_numpy(host).to(device, torch.int64)
            if cache.shared:
                firsts = host[host % c.page_tokens == 0]
                if len(firsts):
                    fresh = (firsts[:, None] + np.arange(c.page_tokens)).ravel()
                    cache.kv[:, :, torch.from_numpy(fresh).to(device)] = 0
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
