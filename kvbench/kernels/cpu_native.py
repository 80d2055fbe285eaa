"""The ``native`` CPU backend: decodes attended by a C kernel that reads the KV pool in place.

Every decode of a step (a sequence with one query row) is attended in one call per layer of
``cpu_decode.c``, which walks each sequence's block table (or extent) over the pool, with no
gathered copy and no per-sequence call from Python; this is how vLLM's CPU attention reads its
paged cache. Prefill chunks, quantised or non-float32 caches, key positions (page classes) and
sliding windows go to the torch reference (:mod:`kvbench.kernels.reference`), whose
signatures this backend keeps; so do the KV store, slot copies and merges.

The kernel is built on first use by :mod:`~kvbench.kernels.native_build`, as every C
source in kvbench is. Without a compiler the backend is refused with a message, and ``auto``
uses the reference.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvbench.errors import KvbenchError
from kvbench.kernels import reference
from kvbench.kernels.native_build import BuildError, build, compiler
from kvbench.kernels.reference_plan import AttentionPlan

SOURCE = Path(__file__).with_name("cpu_decode.c")


def library() -> ctypes.CDLL:
    """The compiled kernel, built once per source, flags, compiler and CPU (raises
    :class:`KvbenchError` saying why it cannot be)."""
    lib = _load()
    if isinstance(lib, str):
        raise KvbenchError(f"{lib}; or use --attention reference")
    return lib


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built and loaded here, or None when it can."""
    lib = _load()
    return lib if isinstance(lib, str) else None


@cache
def _load() -> ctypes.CDLL | str:
    """The kernel, or why it cannot be built (tried once per process)."""
    cc = compiler()
    if cc is None:
        return "the native attention kernel needs a C compiler (set CC, or install gcc or clang)"
    try:
        return _bind(build(SOURCE, cc))
    except BuildError as e:
        return f"could not build the native attention kernel ({e})"


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvb_decode_attention.restype = ctypes.c_int
    lib.kvb_decode_attention.argtypes = [
        ptr, i64, i64,                 # query and its row, head strides
        ptr, ptr, i64, i64,            # k, v caches, their slot stride and slots
        i64, ptr, ptr, ptr,            # n, seqs, rows, context_lens
        ptr, i64, i64,                 # block tables, their row stride, block size
        ptr,                           # extent starts
        i64, i64, i64, ctypes.c_float,  # Hq, Hkv, D, scale
        ptr, ptr,                      # out, lse
    ]
    return lib


def available() -> bool:
    """Whether the kernel builds and loads here."""
    return unavailable_reason() is None


@dataclass(frozen=True, slots=True)
class NativePlan:
    """One step's split: the decodes (sequence indices, their query rows, int64) for the C
    kernel, in ``parts`` of about equal keys, one per CPU thread; the other sequences (their
    query rows, their layout's rows, context lengths and ``cu_seqlens_q``) with the
    reference's ``rest_plan`` of them (all None when there are none)."""

    num_rows: int
    num_slots: int
    parts: tuple[tuple[Tensor, Tensor], ...]
    rest_rows: Tensor | slice | None = None
    rest_layout: Tensor | None = None
    rest_lens: Tensor | None = None
    rest_cu: Tensor | None = None
    rest_plan: AttentionPlan | None = None


# Decodes are split among torch's CPU threads only when they read this many keys or more.
# Measured on a 2-core VM (64 decodes, tiny's heads): the hand-off to a second thread costs
# 100-150 us, as much as attending 8,192 keys (207 us on one thread, 214 us on two); at
# 16,384 keys two threads take 305 us against 428 us.
PARALLEL_MIN_KEYS = 16384


def _split(layout: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor, num_slots: int
           ) -> NativePlan:
    """The decodes in parts and the other sequences of ``layout`` (tables or extents), no
    ``rest_plan`` yet."""
    cu = cu_seqlens_q.cpu().numpy().astype(np.int64)
    lens = np.diff(cu)
    dec = np.flatnonzero(lens == 1)
    other = np.flatnonzero(lens != 1)
    rest: dict[str, Any] = {}
    if other.size:
        rows = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in other])
        # Usually the prefill chunks' rows are one run: a view rather than a copy.
        contiguous = rows.size and rows[-1] - rows[0] + 1 == rows.size
        index = torch.from_numpy(other)
        rest = dict(
            rest_rows=(slice(int(rows[0]), int(rows[-1]) + 1) if contiguous
                       else torch.from_numpy(rows)),
            rest_layout=layout[index], rest_lens=context_lens[index],
            rest_cu=torch.from_numpy(np.concatenate([[0], np.cumsum(lens[other])])
                                     .astype(np.int32)))
    keys = np.cumsum(context_lens.cpu().numpy()[dec], dtype=np.int64)
    threads = min(torch.get_num_threads(), dec.size)
    cuts = [0, dec.size]
    if threads > 1 and keys.size and keys[-1] >= PARALLEL_MIN_KEYS:
        cuts[1:1] = np.searchsorted(keys, keys[-1] * np.arange(1, threads) / threads).tolist()
    parts = tuple((torch.from_numpy(dec[a:b]), torch.from_numpy(cu[dec[a:b]]))
                  for a, b in itertools.pairwise(cuts) if b > a)
    return NativePlan(int(cu[-1]), num_slots, parts, **rest)


def _cache_ok(k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the C kernel reads caches like these: float32 on the CPU, a slot's heads and
    their D floats packed, D a multiple of 8 up to 256."""
    d = k_cache.shape[-1]
    return (k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
            and k_cache.stride(-2) == d and d % 8 == 0 and d <= 256)


def _native_ok(query: Tensor, k_cache: Tensor, v_cache: Tensor, options: dict[str, Any]) -> bool:
    """Whether the C kernel can take this call's decodes."""
    return (_cache_ok(k_cache, v_cache) and query.dtype == torch.float32
            and query.stride(-1) == 1
            and all(options.get(k) is None
                    for k in ("k_scale", "v_scale", "slot_positions", "window")))


def plan_paged(block_tables: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor,
               block_size: int, k_cache: Tensor, v_cache: Tensor, num_heads: int, *,
               positions: bool = False, window: int | None = None,
               previous: Any = None) -> NativePlan | AttentionPlan:
    """As :func:`reference.plan_paged`; the reference plans what the kernel does not take."""

    def ref(tables: Tensor, lens: Tensor, cu: Tensor, **kw: Any) -> AttentionPlan:
        return reference.plan_paged(tables, lens, cu, block_size, k_cache, v_cache, num_heads,
                                    **kw)

    return _plan(ref, block_tables, context_lens, cu_seqlens_q, k_cache, v_cache, positions,
                 window, previous)


def plan_contiguous(extent_starts: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor,
                    k_cache: Tensor, v_cache: Tensor, num_heads: int, *,
                    positions: bool = False, window: int | None = None,
                    previous: Any = None) -> NativePlan | AttentionPlan:
    """As :func:`reference.plan_contiguous` (see :func:`plan_paged`)."""

    def ref(starts: Tensor, lens: Tensor, cu: Tensor, **kw: Any) -> AttentionPlan:
        return reference.plan_contiguous(starts, lens, cu, k_cache, v_cache, num_heads, **kw)

    return _plan(ref, extent_starts, context_lens, cu_seqlens_q, k_cache, v_cache, positions,
                 window, previous)


def _plan(ref: Callable[..., AttentionPlan], layout: Tensor, context_lens: Tensor,
          cu_seqlens_q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: bool,
          window: int | None, previous: Any) -> NativePlan | AttentionPlan:
    """The plan of a layout (its tables or extents) whose reference planner is ``ref``."""
    previous = _reference_plan(previous)
    if positions or window is not None or not _cache_ok(k_cache, v_cache):
        return ref(layout, context_lens, cu_seqlens_q, positions=positions, window=window,
                   previous=previous)
    plan = _split(layout, context_lens, cu_seqlens_q, k_cache.shape[0])
    if plan.rest_layout is None:
        return plan
    return replace(plan, rest_plan=ref(plan.rest_layout, plan.rest_lens, plan.rest_cu,
                                       previous=previous))


def _reference_plan(previous: Any) -> AttentionPlan | None:
    if isinstance(previous, NativePlan):
        return previous.rest_plan
    return previous if isinstance(previous, AttentionPlan) else None


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    context_lens: Tensor, cu_seqlens_q: Tensor, block_size: int, scale: float,
                    **options: Any) -> Tensor | tuple[Tensor, Tensor]:
    """As :func:`reference.paged_attention`."""
    plan = options.pop("plan", None)
    if isinstance(plan, AttentionPlan) or not _native_ok(query, k_cache, v_cache, options):
        return reference.paged_attention(
            query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, block_size,
            scale, plan=plan if isinstance(plan, AttentionPlan) else None, **options)
    if not isinstance(plan, NativePlan):
        plan = plan_paged(block_tables, context_lens, cu_seqlens_q, block_size, k_cache,
                          v_cache, query.shape[1])
    assert isinstance(plan, NativePlan)

    def rest(q: Tensor, plan: NativePlan, **kw: Any) -> Any:
        return reference.paged_attention(q, k_cache, v_cache, plan.rest_layout, plan.rest_lens,
                                         plan.rest_cu, block_size, scale, plan=plan.rest_plan,
                                         **kw)

    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    return _attend(query, k_cache, v_cache, context_lens, scale, plan, options, rest,
                   tables=tables.contiguous(), block_size=block_size)


def contiguous_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor,
                         extent_starts: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor,
                         scale: float, **options: Any) -> Tensor | tuple[Tensor, Tensor]:
    """As :func:`reference.contiguous_attention`."""
    plan = options.pop("plan", None)
    if isinstance(plan, AttentionPlan) or not _native_ok(query, k_cache, v_cache, options):
        return reference.contiguous_attention(
            query, k_cache, v_cache, extent_starts, context_lens, cu_seqlens_q, scale,
            plan=plan if isinstance(plan, AttentionPlan) else None, **options)
    if not isinstance(plan, NativePlan):
        plan = plan_contiguous(extent_starts, context_lens, cu_seqlens_q, k_cache, v_cache,
                               query.shape[1])
    assert isinstance(plan, NativePlan)

    def rest(q: Tensor, plan: NativePlan, **kw: Any) -> Any:
        return reference.contiguous_attention(q, k_cache, v_cache, plan.rest_layout,
                                              plan.rest_lens, plan.rest_cu, scale,
                                              plan=plan.rest_plan, **kw)

    starts = extent_starts if extent_starts.dtype == torch.int64 else extent_starts.long()
    return _attend(query, k_cache, v_cache, context_lens, scale, plan, options, rest,
                   starts=starts.contiguous())


@cache
def _workers(n: int) -> ThreadPoolExecutor:
    """Threads that take the decodes' other parts (one pool per count, made when first used)."""
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvbench-attention")


def _attend(query: Tensor, k_cache: Tensor, v_cache: Tensor, context_lens: Tensor,
            scale: float, plan: NativePlan, options: dict[str, Any], rest: Any, *,
            tables: Tensor | None = None, block_size: int = 0,
            starts: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    if (plan.num_rows, plan.num_slots) != (query.shape[0], k_cache.shape[0]):
        raise KvbenchError(
            f"attention plan made for (rows, slots) {(plan.num_rows, plan.num_slots)}, used "
            f"with {(query.shape[0], k_cache.shape[0])}")
    return_lse = bool(options.get("return_lse"))
    rows, hq, d = query.shape
    out = torch.empty(query.shape, dtype=torch.float32)
    lse = torch.empty(rows, hq) if return_lse else None
    if plan.parts:
        ctx = context_lens if context_lens.dtype == torch.int32 else context_lens.int()
        ctx = ctx.contiguous()
        kernel = library().kvb_decode_attention

        def attend(seqs: Tensor, rows: Tensor) -> None:
            rc = kernel(
                query.data_ptr(), query.stride(0), query.stride(1),
                k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.shape[0],
                seqs.shape[0], seqs.data_ptr(), rows.data_ptr(), ctx.data_ptr(),
                tables.data_ptr() if tables is not None else None,
                tables.stride(0) if tables is not None else 0, block_size,
                starts.data_ptr() if starts is not None else None,
                hq, k_cache.shape[1], d, scale,
                out.data_ptr(), lse.data_ptr() if lse is not None else None)
            if rc == -1:
                raise MemoryError("the native attention kernel could not allocate its buffers")
            if rc == -3:
                raise KvbenchError(
                    "a block table or extent of a decode reaches outside the KV pool "
                    f"({k_cache.shape[0]} slots)")
            assert rc == 0, f"native attention kernel returned {rc}"

        # ctypes lets go of the GIL during the call: the parts run at once, on their own rows.
        others = [_workers(len(plan.parts) - 1).submit(attend, *p) for p in plan.parts[1:]]
        attend(*plan.parts[0])
        for f in others:
            f.result()
    if plan.rest_rows is not None:
        sel = plan.rest_rows
        q = query[sel] if isinstance(sel, slice) else query.index_select(0, sel)
        got = rest(q, plan, **options)
        o, part_lse = got if return_lse else (got, None)
        out[sel] = o
        if lse is not None:
            lse[sel] = part_lse
    return (out, lse) if lse is not None else out
