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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from kvbench.errors import KvbenchError

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


# The batch size and block-table width change from step to step; specialising on them (value
# 1, multiples of 16) would recompile the kernel mid-run for no gain.
@triton.jit(do_not_specialize=["num_seqs", "stride_tb"])
def _attention_kernel(
    out_ptr, part_out_ptr, part_lse_ptr,
    q_ptr, k_ptr, v_ptr,
    tables_ptr, starts_ptr, ctx_ptr, cu_q_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_tb,
    stride_pt, stride_ph, stride_ps,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    PAGED: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
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

    # Causal: the tile's last query sees positions up to its own; later keys are skipped.
    kv_end = ctx - q_len + tl.minimum(q0 + BLOCK_Q, q_len)
    kv_lo = kv_end * 0
    kv_hi = kv_end
    if SPLIT:
        active = tl.maximum(tl.minimum(num_splits, tl.cdiv(kv_end, MIN_SPLIT_TOKENS)), 1)
        per_split = tl.cdiv(tl.cdiv(kv_end, active), BLOCK_N) * BLOCK_N
        kv_lo = split * per_split
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
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = q_rows[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part * HEAD_DIM + d[None, :], acc, mask=mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
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


@triton.jit
def _combine_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_splits,
    stride_ot, stride_oh, stride_od,
    stride_pt, stride_ph,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
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
    num_splits: int | None = None,
) -> Tensor:
    """Varlen attention reading each sequence's KV through its block table.

    ``num_splits`` overrides how many programs share one decode sequence's context (default:
    enough to fill the GPU for decode-only batches, else 1).
    """
    return _attention(
        query, k_cache, v_cache, context_lens, cu_seqlens_q, scale, num_splits,
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
    num_splits: int | None = None,
) -> Tensor:
    """Varlen attention reading each sequence's KV from its contiguous extent."""
    return _attention(
        query, k_cache, v_cache, context_lens, cu_seqlens_q, scale, num_splits,
        tables=None, starts=extent_starts, block_size=1,
    )


def _attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    num_splits: int | None,
    *,
    tables: Tensor | None,
    starts: Tensor | None,
    block_size: int,
) -> Tensor:
    check_device(query.device)
    if not (query.dtype == k_cache.dtype == v_cache.dtype) or query.dtype not in TILES:
        raise KvbenchError(
            f"triton attention needs query and KV cache in one of float16, bfloat16, float32; "
            f"got {query.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
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
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _attention_kernel[grid](
        out, part_out, part_lse,
        query, k_cache, v_cache,
        tables if tables is not None else context_lens,
        starts if starts is not None else context_lens,
        context_lens, cu_seqlens_q,
        num_seqs, scale * LOG2E,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        tables.stride(0) if tables is not None else 0,
        num_heads * num_splits, num_splits, 1,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=d_pad,
        GROUP=group, G_PAD=g_pad,
        BLOCK_Q=block_q, BLOCK_M=max(MIN_DOT, block_q * g_pad), BLOCK_N=block_n,
        MIN_SPLIT_TOKENS=MIN_SPLIT_TOKENS,
        PAGED=tables is not None, SPLIT=split, UPCAST=upcast,
        # float32 inputs get exact float32 products, as in the reference, not TF32.
        PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        num_stages=num_stages,
    )
    if split:
        _combine_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, num_splits,
            *out.stride(),
            num_heads * num_splits, num_splits,
            HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
            S_PAD=triton.next_power_of_2(num_splits),
        )
    return out


def _default_splits(device: torch.device, num_seqs: int, num_kv_heads: int) -> int:
    """Splits per sequence that give every SM a few programs; 1 off CUDA (the interpreter
    runs programs one by one, so splitting only adds work there)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    base = num_seqs * num_kv_heads
    return max(1, min(MAX_SPLITS, triton.cdiv(WAVES_PER_SM * sms, base)))
