"""Triton KV store and slot copy with the signatures of :mod:`kvbench.kernels.reference`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvbench.errors import KvbenchError
from kvbench.kernels.triton_attention import check_device

if TYPE_CHECKING:
    from kvbench.kernels.slot_copy import SlotCopy

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


def store_kv(
    k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` to slots ``slot_mapping``
    ``[T]`` int64 (distinct slots)."""
    check_device(k_cache.device)
    if not (k_cache.dtype == v_cache.dtype == key.dtype == value.dtype):
        raise KvbenchError(
            f"store_kv needs one dtype for caches and new KV; got {k_cache.dtype}, "
            f"{v_cache.dtype}, {key.dtype}, {value.dtype}"
        )
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kernel[(num_tokens,)](
        k_cache, v_cache, key, value, slot_mapping,
        *k_cache.stride(), *v_cache.stride(), *key.stride(), *value.stride(),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim),
    )


# (src, dst, num_slots)
_Move = tuple[int, int, int]


def copy_slots(caches: Tensor, copies: Sequence[SlotCopy]) -> None:
    """Apply slot-range copies, in order, to every cache at once.

    ``caches`` is ``[num_caches, S, ...]``. The result is as if each copy read through a
    temporary, one after another. Consecutive copies that neither read nor write what an
    earlier one in the same run writes go in one launch (copy-on-write of many blocks); a
    copy overlapping itself (compaction sliding an extent) goes through a bounded staging
    buffer.
    """
    check_device(caches.device)
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
