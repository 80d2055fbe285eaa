"""Triton KV store and slot copy with the signatures of :mod:`kvbench.kernels.reference`.

A quantised store (see :mod:`kvbench.kernels.quant`) plans its scale updates with torch ops on
the device (no read-back), then runs two kernels: one program per scale group whose scale
rose requantises the group's codes in place, and once that is done one program per token
writes the token's codes at its group's new scale. Slot copies move scale groups as ranges of
the scale tensor, with the same kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.errors import KvbenchError
from kvbench.kernels.quant import QMAX, check_aligned, copy_group, plan_scales, scale_group
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.kernels.triton_attention import check_device

COPY_SLOTS = 16  # slots per program and step of a copy
COPY_ROW = 256  # row elements per inner step
# Programs per copy along its slots: a grid-stride loop covers longer copies, and this
# keeps the grid inside CUDA's 65535 limit on its second axis.
MAX_COPY_PROGRAMS = 4096
# Bound on the staging buffer of one overlapping copy (a compaction sliding a long extent).
STAGING_BYTES = 64 * 2**20


@triton.jit
def _store_kernel(
    k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, slots_ptr,
    stride_kcs, stride_kch, stride_kcd,
    stride_vcs, stride_vch, stride_vcd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """One token: its K and V for every KV head into its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    tl.store(k_cache_ptr + slot * stride_kcs + h * stride_kch + d * stride_kcd, k, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vcs + h * stride_vch + d * stride_vcd, v, mask=mask)


@triton.jit
def _copy_kernel(
    dst_ptr, src_ptr, dst_starts_ptr, src_starts_ptr, lengths_ptr,
    row_len,
    stride_dc, stride_ds, stride_dr,
    stride_sc, stride_ss, stride_sr,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Copy i, cache c: ``dst[c, dst_start : +len] = src[c, src_start : +len]`` (rows of
    ``row_len`` elements); the caller guarantees no copy reads what another writes."""
    i = tl.program_id(0)
    c = tl.program_id(2).to(tl.int64)
    n = tl.load(lengths_ptr + i)
    src0 = tl.load(src_starts_ptr + i).to(tl.int64)
    dst0 = tl.load(dst_starts_ptr + i).to(tl.int64)
    for s0 in range(tl.program_id(1) * BLOCK_S, n, tl.num_programs(1) * BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < n
        for r0 in range(0, row_len, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            mask = s_ok[:, None] & (r < row_len)[None, :]
            x = tl.load(
                src_ptr + c * stride_sc + (src0 + s)[:, None] * stride_ss + r[None, :] * stride_sr,
                mask=mask,
            )
            tl.store(
                dst_ptr + c * stride_dc + (dst0 + s)[:, None] * stride_ds + r[None, :] * stride_dr,
                x, mask=mask,
            )


@triton.jit
def _requantise_kernel(
    cache_ptr, slots_ptr, ratio_ptr, redo_ptr,
    stride_cs, stride_ch, stride_cd, stride_rt, stride_rh,
    QMAX: tl.constexpr, INT8: tl.constexpr, SCALE_GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """One planned token: if it leads a group whose scale rose, rescale the group's codes
    written so far (the slots before the token's)."""
    t = tl.program_id(0).to(tl.int64)
    if tl.load(redo_ptr + t) == 0:
        return
    slot = tl.load(slots_ptr + t).to(tl.int64)
    first = slot - slot % SCALE_GROUP
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    ratio = tl.load(ratio_ptr + t * stride_rt + h * stride_rh, mask=h < NUM_HEADS, other=1.0)
    for i in range(slot - first):
        ptr = cache_ptr + (first + i) * stride_cs + h * stride_ch + d * stride_cd
        y = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * ratio
        tl.store(ptr, _to_codes(y, QMAX, INT8).to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _to_codes(y, QMAX: tl.constexpr, INT8: tl.constexpr):
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if INT8:  # noqa: SIM108 (a constexpr branch keeps the other rounding out of the kernel)
        # Round half up, as the reference does; the clamp above keeps it in range.
        y = tl.floor(y + 0.5)
    else:
        y = _round_e4m3(y)
    return y


@triton.jit
def _round_e4m3(y):
    """``y`` rounded to the nearest float8 e4m3 value (ties to even) in float32 arithmetic,
    so the cast after it is exact: the interpreter's own cast drops the carry when rounding
    up crosses a power of two (124.7 becomes 64)."""
    bits = y.to(tl.int32, bitcast=True)
    # Adding 2^(e + 20) to a value of exponent e leaves float32 steps of 2^(e - 3): e4m3's
    # 3-bit mantissa. Below 2^-6 e4m3 is subnormal, with the steps of 2^-6.
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    shift = ((exponent + 20) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + shift) - shift
    return tl.where(bits < 0, -r, r)


@triton.jit
def _quantised_store_kernel(
    cache_ptr, x_ptr, order_ptr, slots_ptr, scale_ptr,
    stride_cs, stride_ch, stride_cd, stride_xt, stride_xh, stride_xd, stride_st, stride_sh,
    QMAX: tl.constexpr, INT8: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """One planned token: its codes at its group's new scale into its slot."""
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(order_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    x = tl.load(x_ptr + row * stride_xt + h * stride_xh + d * stride_xd, mask=mask, other=0.0)
    s = tl.load(scale_ptr + t * stride_st + h * stride_sh, mask=h < NUM_HEADS, other=0.0)
    y = tl.where(s > 0.0, x.to(tl.float32) / tl.where(s > 0.0, s, 1.0), 0.0)
    tl.store(
        cache_ptr + slot * stride_cs + h * stride_ch + d * stride_cd,
        _to_codes(y, QMAX, INT8).to(cache_ptr.dtype.element_ty), mask=mask,
    )


def store_kv(
    k_cache: Tensor,
    v_cache: Tensor,
    key: Tensor,
    value: Tensor,
    slot_mapping: Tensor,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` to slots ``slot_mapping``
    ``[T]`` int64 (distinct slots); a quantised cache encodes them, updating its scales."""
    check_device(k_cache.device)
    k_group = scale_group(k_cache, k_scale, "k_scale")
    v_group = scale_group(v_cache, v_scale, "v_scale")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_scale is not None and v_scale is not None:
        _store_quantised(k_cache, key, slot_mapping, k_scale, k_group)
        _store_quantised(v_cache, value, slot_mapping, v_scale, v_group)
        return
    if not (k_cache.dtype == v_cache.dtype == key.dtype == value.dtype):
        raise KvbenchError(
            f"store_kv needs one dtype for caches and new KV; got {k_cache.dtype}, "
            f"{v_cache.dtype}, {key.dtype}, {value.dtype}"
        )
    _store_kernel[(num_tokens,)](
        k_cache, v_cache, key, value, slot_mapping,
        *k_cache.stride(), *v_cache.stride(), *key.stride(), *value.stride(),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim),
    )


def _store_quantised(cache: Tensor, x: Tensor, slot_mapping: Tensor, scale: Tensor,
                     group: int) -> None:
    plan = plan_scales(scale, x, slot_mapping, group, cache.dtype)
    num_tokens, num_heads, head_dim = x.shape
    consts = dict(
        QMAX=QMAX[cache.dtype], INT8=cache.dtype == torch.int8,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim),
    )
    _requantise_kernel[(num_tokens,)](
        cache, plan.slots, plan.ratio, plan.requantise.to(torch.int8),
        *cache.stride(), *plan.ratio.stride(), SCALE_GROUP=group, **consts,
    )
    scale[plan.groups] = plan.new
    _quantised_store_kernel[(num_tokens,)](
        cache, x, plan.order, plan.slots, plan.new,
        *cache.stride(), *x.stride(), *plan.new.stride(), **consts,
    )


# (src, dst, num_slots)
_Move = tuple[int, int, int]


def copy_slots(
    caches: Tensor, copies: Sequence[SlotCopy], scales: Tensor | None = None
) -> None:
    """Apply slot-range copies, in order, to every cache at once.

    ``caches`` is ``[num_caches, S, ...]``; ``scales``, for a quantised pool, is
    ``[num_caches, S // group, ...]`` and its groups move with their slots. The result is as
    if each copy read through a temporary, one after another. Consecutive copies that neither
    read nor write what an earlier one in the same run writes go in one launch (copy-on-write
    of many blocks); a copy overlapping itself (compaction sliding an extent) goes through a
    bounded staging buffer.
    """
    check_device(caches.device)
    if scales is not None:
        group = copy_group(caches, scales)
        for c in copies:
            check_aligned(c, group)
        _copy(scales, [SlotCopy(c.src // group, c.dst // group, -(-c.num_slots // group))
                       for c in copies])
    # Codes move as bytes: the interpreter does not load every float8 type.
    _copy(caches.view(torch.uint8) if caches.element_size() == 1 else caches, copies)


def _copy(caches: Tensor, copies: Sequence[SlotCopy]) -> None:
    flat = caches.view(caches.shape[0], caches.shape[1], -1)
    run: list[_Move] = []
    for c in copies:
        if c.src == c.dst or c.num_slots <= 0:
            continue
        move = (c.src, c.dst, c.num_slots)
        if abs(c.src - c.dst) < c.num_slots:
            _launch(flat, flat, run)
            run = []
            _move_overlapping(flat, move)
        elif any(_conflict(move, m) for m in run):
            _launch(flat, flat, run)
            run = [move]
        else:
            run.append(move)
    _launch(flat, flat, run)


def _conflict(later: _Move, earlier: _Move) -> bool:
    """Whether running two moves at once could differ from running them in order: the later
    one reads what the earlier writes, or writes what the earlier reads or writes."""
    (src, dst, n), (e_src, e_dst, e_n) = later, earlier
    return (
        _overlap(src, n, e_dst, e_n) or _overlap(dst, n, e_src, e_n) or _overlap(dst, n, e_dst, e_n)
    )


def _overlap(a: int, n: int, b: int, m: int) -> bool:
    return a < b + m and b < a + n


def _move_overlapping(flat: Tensor, move: _Move) -> None:
    """A move whose source and destination overlap, in pieces through a staging buffer.

    Sliding left (dst < src), pieces go front to back: a piece's destination ends before any
    source slot not yet read; sliding right, back to front by symmetry.
    """
    src, dst, num_slots = move
    num_caches, _, row = flat.shape
    piece = max(1, min(num_slots, STAGING_BYTES // (num_caches * row * flat.element_size())))
    staging = torch.empty((num_caches, piece, row), dtype=flat.dtype, device=flat.device)
    offsets = range(0, num_slots, piece)
    for off in reversed(offsets) if dst > src else offsets:
        n = min(piece, num_slots - off)
        _launch(staging, flat, [(src + off, 0, n)])
        _launch(flat, staging, [(0, dst + off, n)])


def _launch(dst: Tensor, src: Tensor, moves: list[_Move]) -> None:
    """One launch for ``moves`` from ``src`` into ``dst`` (both ``[num_caches, slots,
    row]``); no move may read or write what another writes."""
    if not moves:
        return
    srcs, dsts, lens = zip(*moves, strict=True)
    table = torch.tensor([dsts, srcs, lens], dtype=torch.int64).to(dst.device)
    row = dst.shape[2]
    grid = (len(moves), min(triton.cdiv(max(lens), COPY_SLOTS), MAX_COPY_PROGRAMS), dst.shape[0])
    _copy_kernel[grid](
        dst, src, table[0], table[1], table[2],
        row, *dst.stride(), *src.stride(),
        BLOCK_S=COPY_SLOTS, BLOCK_R=min(COPY_ROW, triton.next_power_of_2(row)),
    )
