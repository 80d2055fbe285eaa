"""Triton paged and contiguous attention with the signatures of :mod:`kvbench.kernels.reference`.

One kernel serves both KV layouts and every mix of decodes and prefill chunks; a constexpr
picks how a token position becomes a slot (block table lookup or extent start + position),
so a paged-vs-contiguous benchmark measures exactly the cost of the indirection.

Work is split into query tiles: ``BLOCK_Q`` query tokens of one sequence times the
``GROUP`` query heads that share one KV head (GQA), stacked as the ``BLOCK_M`` rows of one
``tl.dot`` against each KV tile, so every K/V element is loaded once per tile. A program
finds its sequence by binary search over ``cu_seqlens_q``: the grid is sized from the tensor
shapes alone, so launching reads nothing back from the device.

Decode-only batches (one query per sequence) with few sequences cannot fill the GPU with one
program per (sequence, KV head), so their context is split across programs (split-K, as in
FlashDecoding); each writes a partial result with its log-sum-exp and a second kernel
combines them.

Quantised pages (int8, float8 e4m3; see :mod:`kvbench.kernels.quant`) are loaded as codes and
cast to the query's dtype, where they are exact, so the tensor-core products are too; each
key's scale multiplies its column of scores and each value's scale its column of
probabilities, which is cheaper than dequantising the tiles. With key positions, every key of
the sequence in the pool is a candidate and visibility compares positions, so no causal tile
is skipped. The log-sum-exp the online softmax keeps (in log2 units) is written out in
natural-log units when asked for, and ``merge_attention`` combines two partial results with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from kvbench.errors import KvbenchError
from kvbench.kernels.quant import QMAX, is_quantised, scale_group
from kvbench.kernels.reference import check_window

# tl.dot needs every dimension >= 16 on GPUs.
MIN_DOT = 16
# Per dtype: KV tokens per loop iteration, query rows (tokens x heads of a group) per
# prefill tile, pipeline stages. float32 tiles are halved so that their shared memory
# (about 50 KiB) fits GPUs with 100 KiB per block, such as the L40S.
TILES = {torch.float16: (64, 64, 3), torch.bfloat16: (64, 64, 3), torch.float32: (32, 32, 2)}
# Split-K: aim for this many programs per SM, cap the splits, and give each at least this
# many KV tokens (shorter splits cost more in the combine than they save).
WAVES_PER_SM = 4
MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 256
LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


# The batch size and block-table width change from step to step; specialising on them (value
# 1, multiples of 16) would recompile the kernel mid-run for no gain.
@triton.jit(do_not_specialize=["num_seqs", "stride_tb"])
def _attention_kernel(
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, slot_pos_ptr, q_pos_ptr,
    tables_ptr, starts_ptr, ctx_ptr, cu_q_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_ksg, stride_ksh, stride_vsg, stride_vsh,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_tb,
    stride_pt, stride_ph, stride_ps,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    PAGED: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    POSITIONS: tl.constexpr, RETURN_LSE: tl.constexpr, WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # Sequence b owns tiles from cu_q[b] // BLOCK_Q + b on: an upper bound of the tiles
    # before it that needs no prefix sum over the batch. Find the last b starting <= tile.
    lo = tl.program_id(0) * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ahead = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid > tile
        lo = tl.where(ahead, lo, mid)
        hi = tl.where(ahead, mid, hi)
    b = lo
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    q0 = (tile - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if q0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // G_PAD
    head = kvh * GROUP + rows % G_PAD
    row_ok = (rows // G_PAD < BLOCK_Q) & (rows % G_PAD < GROUP) & (q_idx < q_len)
    q_pos = ctx - q_len + q_idx
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if POSITIONS:
        # Keys carry their own positions: every key of the sequence in this pool may be
        # visible, so none is skipped.
        q_abs = tl.load(q_pos_ptr + q_rows, mask=row_ok, other=-1)
        kv_end = ctx
    else:
        # Causal: the tile's last query sees positions up to its own; later keys are skipped.
        kv_end = ctx - q_len + tl.minimum(q0 + BLOCK_Q, q_len)
    kv_begin = kv_end * 0
    if WINDOW > 0:
        # Nor does any query see keys before its window: whole tiles before the first
        # query's are skipped (their blocks may have been freed and reused).
        kv_begin = tl.maximum(ctx - q_len + q0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    kv_lo = kv_begin
    kv_hi = kv_end
    if SPLIT:
        span = kv_end - kv_begin
        active = tl.maximum(tl.minimum(num_splits, tl.cdiv(span, MIN_SPLIT_TOKENS)), 1)
        per_split = tl.cdiv(tl.cdiv(span, active), BLOCK_N) * BLOCK_N
        kv_lo = kv_begin + split * per_split
        kv_hi = tl.minimum(kv_end, kv_lo + per_split)
    if not PAGED:
        extent = tl.load(starts_ptr + b).to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_hi
        if PAGED:
            if BLOCK_SIZE % BLOCK_N == 0:
                # Tiles start at multiples of BLOCK_N, so this one lies inside one block.
                block = tl.load(tables_ptr + b * stride_tb + start // BLOCK_SIZE)
            else:
                block = tl.load(
                    tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=pos_ok, other=0
                )
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        else:
            slot = extent + pos
        k = tl.load(
            k_ptr + slot[None, :] * stride_ks + kvh * stride_kh + d[:, None] * stride_kd,
            mask=pos_ok[None, :] & d_ok[:, None], other=0.0,
        )
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :] * stride_vd,
            mask=pos_ok[:, None] & d_ok[None, :], other=0.0,
        )
        if UPCAST or QUANT:
            # Codes are exact in the query's dtype (int8 and e4m3 fit a 16-bit float), so
            # the products are; the scales are applied to scores and probabilities.
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if QUANT:
            k_sc = tl.load(
                k_scale_ptr + (slot // K_GROUP) * stride_ksg + kvh * stride_ksh,
                mask=pos_ok, other=0.0,
            )
            s = s * k_sc[None, :]
        if POSITIONS:
            k_abs = tl.load(slot_pos_ptr + slot, mask=pos_ok, other=0)
            visible = pos_ok[None, :] & (k_abs[None, :] <= q_abs[:, None])
        else:
            visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            v_sc = tl.load(
                v_scale_ptr + (slot // V_GROUP) * stride_vsg + kvh * stride_vsh,
                mask=pos_ok, other=0.0,
            )
            pv = (p * v_sc[None, :]).to(v.dtype)
        else:
            pv = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if SPLIT:
        part = q_rows[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part * HEAD_DIM + d[None, :], acc, mask=mask)
        tl.store(
            part_lse_ptr + q_rows * stride_pt + head * stride_ph + split * stride_ps,
            lse, mask=row_ok,
        )
    else:
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
            + d[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty), mask=mask,
        )
        if RETURN_LSE:
            # Scores ran in log2 units; callers get natural logs.
            tl.store(lse_ptr + q_rows * stride_lt + head * stride_lh, lse * LN2, mask=row_ok)


@triton.jit
def _combine_kernel(
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, num_splits,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    stride_pt, stride_ph,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """One (query row, head): weight each split's normalised output by its softmax mass."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < num_splits
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    base = t * stride_pt + h * stride_ph
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(
        part_out_ptr + (base + s[:, None]) * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    )
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d * stride_od,
        o.to(out_ptr.dtype.element_ty), mask=d_ok,
    )
    if RETURN_LSE:
        lse = tl.where(total > 0.0, m + tl.log2(tl.where(total > 0.0, total, 1.0)),
                       float("-inf"))
        tl.store(lse_ptr + t * stride_lt + h * stride_lh, lse * LN2)


@triton.jit
def _merge_kernel(
    out_ptr, lse_ptr, out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr,
    stride_ot, stride_oh, stride_od,
    stride_at, stride_ah, stride_ad,
    stride_bt, stride_bh, stride_bd,
    stride_lt, stride_lh, stride_lat, stride_lah, stride_lbt, stride_lbh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """One (query row, head): two partial outputs weighted by their softmax mass."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    lse_a = tl.load(lse_a_ptr + t * stride_lat + h * stride_lah)
    lse_b = tl.load(lse_b_ptr + t * stride_lbt + h * stride_lbh)
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    o_a = tl.load(out_a_ptr + t * stride_at + h * stride_ah + d * stride_ad, mask=d_ok)
    o_b = tl.load(out_b_ptr + t * stride_bt + h * stride_bh + d * stride_bd, mask=d_ok)
    o = (o_a.to(tl.float32) * w_a + o_b.to(tl.float32) * w_b) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d * stride_od,
        o.to(out_ptr.dtype.element_ty), mask=d_ok,
    )
    if RETURN_LSE:
        tl.store(lse_ptr + t * stride_lt + h * stride_lh, m + tl.log(total))


# The interpreter keeps bfloat16 as raw uint16 bits, so arithmetic on it is wrong: under the
# interpreter the kernels compute from float32 copies of what they load.
INTERPRETED = isinstance(_attention_kernel, InterpretedFunction)


def check_device(device: torch.device) -> None:
    """Triton runs on CUDA tensors; CPU tensors only under the interpreter."""
    if device.type == "cuda" or (device.type == "cpu" and INTERPRETED):
        return
    raise KvbenchError(
        f"the triton kernels cannot run on {device}: they need a CUDA device (on a CPU they "
        "run only under the Triton interpreter, TRITON_INTERPRET=1 set before triton is "
        "imported: slow, meant for tests); use the reference attention backend here"
    )


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    block_size: int,
    scale: float,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    slot_positions: Tensor | None = None,
    query_positions: Tensor | None = None,
    return_lse: bool = False,
    window: int | None = None,
    num_splits: int | None = None,
    plan: None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Varlen attention reading each sequence's KV through its block table (on the device:
    ``plan`` is always None, this backend makes none).

    ``num_splits`` overrides how many programs share one decode sequence's context (default:
    enough to fill the GPU for decode-only batches, else 1).
    """
    return _attention(
        query, k_cache, v_cache, context_lens, cu_seqlens_q, scale, num_splits,
        _Extras(k_scale, v_scale, slot_positions, query_positions, return_lse, window),
        tables=block_tables, starts=None, block_size=block_size,
    )


def contiguous_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    extent_starts: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    slot_positions: Tensor | None = None,
    query_positions: Tensor | None = None,
    return_lse: bool = False,
    window: int | None = None,
    num_splits: int | None = None,
    plan: None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Varlen attention reading each sequence's KV from its contiguous extent."""
    return _attention(
        query, k_cache, v_cache, context_lens, cu_seqlens_q, scale, num_splits,
        _Extras(k_scale, v_scale, slot_positions, query_positions, return_lse, window),
        tables=None, starts=extent_starts, block_size=1,
    )


@dataclass(frozen=True, slots=True)
class _Extras:
    """The optional inputs shared with the reference: scales, key positions, lse, a sliding
    window."""

    k_scale: Tensor | None
    v_scale: Tensor | None
    slot_positions: Tensor | None
    query_positions: Tensor | None
    return_lse: bool
    window: int | None = None


def _check_inputs(query: Tensor, k_cache: Tensor, v_cache: Tensor, extras: _Extras) -> bool:
    """Whether the cache is quantised; raises on dtypes the kernel does not take."""
    quantised = is_quantised(k_cache.dtype)
    cache_ok = k_cache.dtype == v_cache.dtype and (quantised or k_cache.dtype == query.dtype)
    if not cache_ok or query.dtype not in TILES:
        raise KvbenchError(
            "triton attention needs the query in float16, bfloat16 or float32 and the KV cache "
            f"in the query's dtype or quantised ({', '.join(map(str, QMAX))}); got "
            f"{query.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if (extras.slot_positions is None) != (extras.query_positions is None):
        raise KvbenchError("slot_positions and query_positions go together")
    check_window(extras.window, extras.slot_positions is not None)
    return quantised


def _attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    num_splits: int | None,
    extras: _Extras,
    *,
    tables: Tensor | None,
    starts: Tensor | None,
    block_size: int,
) -> Tensor | tuple[Tensor, Tensor]:
    check_device(query.device)
    quantised = _check_inputs(query, k_cache, v_cache, extras)
    k_group = scale_group(k_cache, extras.k_scale, "k_scale")
    v_group = scale_group(v_cache, extras.v_scale, "v_scale")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(query)
    lse = torch.full((num_tokens, num_heads), float("-inf"), device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return (out, lse) if extras.return_lse else out
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_n, prefill_rows, num_stages = TILES[query.dtype]
    # num_tokens == num_seqs means every sequence decodes one token (each has >= 1 query).
    decode_only = num_tokens == num_seqs
    block_q = 1 if decode_only else max(1, prefill_rows // g_pad)
    if num_splits is None:
        num_splits = _default_splits(query.device, num_seqs, num_kv_heads) if decode_only else 1
    split = num_splits > 1
    d_pad = max(MIN_DOT, triton.next_power_of_2(head_dim))
    upcast = INTERPRETED and query.dtype != torch.float32
    if split:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        # Never touched with SPLIT off; any tensor fills the pointer slots.
        part_out = part_lse = out
    # Pointer slots of absent optional inputs are never read; any tensor fills them.
    k_scale = extras.k_scale if extras.k_scale is not None else lse
    v_scale = extras.v_scale if extras.v_scale is not None else lse
    positions = extras.slot_positions is not None
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _attention_kernel[grid](
        out, lse, part_out, part_lse,
        query, k_cache, v_cache, k_scale, v_scale,
        extras.slot_positions if positions else context_lens,
        extras.query_positions if positions else context_lens,
        tables if tables is not None else context_lens,
        starts if starts is not None else context_lens,
        context_lens, cu_seqlens_q,
        num_seqs, scale * LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(),
        *k_scale.stride(), *v_scale.stride(),
        *out.stride(), *lse.stride(),
        tables.stride(0) if tables is not None else 0,
        num_heads * num_splits, num_splits, 1,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=d_pad,
        GROUP=group, G_PAD=g_pad,
        BLOCK_Q=block_q, BLOCK_M=max(MIN_DOT, block_q * g_pad), BLOCK_N=block_n,
        MIN_SPLIT_TOKENS=MIN_SPLIT_TOKENS,
        PAGED=tables is not None, SPLIT=split, UPCAST=upcast,
        QUANT=quantised, K_GROUP=max(k_group, 1), V_GROUP=max(v_group, 1),
        POSITIONS=positions, RETURN_LSE=extras.return_lse, WINDOW=extras.window or 0,
        # float32 inputs get exact float32 products, as in the reference, not TF32.
        PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        num_stages=num_stages,
    )
    if split:
        _combine_kernel[(num_tokens, num_heads)](
            out, lse, part_out, part_lse, num_splits,
            *out.stride(), *lse.stride(),
            num_heads * num_splits, num_splits,
            HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
            S_PAD=triton.next_power_of_2(num_splits), RETURN_LSE=extras.return_lse,
        )
    return (out, lse) if extras.return_lse else out


def merge_attention(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *, return_lse: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets from each set's output ``[T, H, D]``
    and log-sum-exp ``[T, H]`` float32; the result has ``out_a``'s dtype."""
    check_device(out_a.device)
    num_tokens, num_heads, head_dim = out_a.shape
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    if num_tokens:
        _merge_kernel[(num_tokens, num_heads)](
            out, lse, out_a, lse_a, out_b, lse_b,
            *out.stride(), *out_a.stride(), *out_b.stride(),
            *lse.stride(), *lse_a.stride(), *lse_b.stride(),
            HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), RETURN_LSE=return_lse,
        )
    return (out, lse) if return_lse else out


def _default_splits(device: torch.device, num_seqs: int, num_kv_heads: int) -> int:
    """Splits per sequence that give every SM a few programs; 1 off CUDA (the interpreter
    runs programs one by one, so splitting only adds work there)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    base = num_seqs * num_kv_heads
    return max(1, min(MAX_SPLITS, triton.cdiv(WAVES_PER_SM * sms, base)))
