"""Torch reference implementations of the KV-cache kernels: the oracle for the Triton kernels,
which keep exactly these signatures, and the backend used on CPU.

Shapes (T = tokens in the flat batch, B = sequences, S = token slots in the pool):

- ``k_cache``, ``v_cache``: one layer's cache, ``[S, num_kv_heads, head_dim]``. Slot ``s``
  holds one token's key (value). A paged manager's view of the same memory is
  ``[S // block_size, block_size, num_kv_heads, head_dim]`` with slot = block x block_size +
  offset, so one layout serves both managers.
- ``query``: ``[T, num_heads, head_dim]``, sequences back to back; ``num_heads`` is a multiple
  of ``num_kv_heads`` (GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``).
- ``cu_seqlens_q``: ``[B + 1]`` int32, sequence ``b``'s queries are rows
  ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``.
- ``context_lens``: ``[B]`` int32, KV positions of sequence ``b`` *including* this step's new
  tokens (already stored). Its ``q_len`` queries are positions ``context_len - q_len ...
  context_len - 1``, each attending causally to positions ``0 ..`` its own. Decode is
  ``q_len == 1``; a prefill chunk is ``q_len > 1`` on top of earlier chunks' KV.
- ``block_tables``: ``[B, max_blocks]`` int32, physical block ids; entries past a sequence's
  last block are ignored (any value). ``num_slots`` is a multiple of ``block_size``.
- ``extent_starts``: ``[B]`` int64, first slot of each sequence's contiguous extent.

Attention accumulates in float32 and returns ``query``'s dtype. The reference pads batched
decodes to the longest context and masks the padding, so slots past a sequence's context in
its last block are read (never used): they must hold finite values, as in the executor's
zero-filled pool. Kernels read only up to ``context_len``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from kvbench.engines.kv.base import SlotCopy


def store_kv(
    k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` to slots ``slot_mapping``
    ``[T]`` int64 (distinct slots)."""
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)


def copy_slots(caches: Tensor, copies: Sequence[SlotCopy]) -> None:
    """Apply slot-range copies, in order, to every cache at once.

    ``caches`` is ``[num_caches, S, ...]`` (the executor passes all layers' K and V as one
    view). Each copy behaves as if read through a temporary, so overlapping ranges (a
    compaction sliding an extent left) are correct.
    """
    for c in copies:
        src = caches[:, c.src : c.src + c.num_slots]
        if abs(c.src - c.dst) < c.num_slots:
            src = src.clone()
        caches[:, c.dst : c.dst + c.num_slots] = src


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    block_size: int,
    scale: float,
) -> Tensor:
    """Varlen attention reading each sequence's KV through its block table."""
    tables = block_tables.long()
    # Gather whole blocks, as a paged kernel does: one index per block, not per token.
    k_blocks = k_cache.view(-1, block_size, *k_cache.shape[1:])
    v_blocks = v_cache.view(-1, block_size, *v_cache.shape[1:])

    def gather(seqs: Tensor, lens: Tensor, length: int) -> tuple[Tensor, Tensor]:
        num_blocks = -(-length // block_size)
        t = tables[seqs, :num_blocks]
        # Entries past a sequence's last block may hold anything: read its first block.
        used = torch.arange(num_blocks, device=t.device)[None, :] < (
            (lens[:, None] + block_size - 1) // block_size
        )
        t = torch.where(used, t, t[:, :1])
        return k_blocks[t].flatten(1, 2)[:, :length], v_blocks[t].flatten(1, 2)[:, :length]

    def one(b: int, ctx: int) -> tuple[Tensor, Tensor]:
        k, v = gather(torch.tensor([b], device=tables.device), context_lens[b : b + 1], ctx)
        return k[0], v[0]

    return _varlen_attention(query, context_lens, cu_seqlens_q, scale, one, gather)


def contiguous_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    extent_starts: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
) -> Tensor:
    """Varlen attention reading each sequence's KV from its contiguous extent."""
    starts = extent_starts.long()
    starts_host = starts.tolist()

    def one(b: int, ctx: int) -> tuple[Tensor, Tensor]:
        s = starts_host[b]
        return k_cache[s : s + ctx], v_cache[s : s + ctx]

    def batch(seqs: Tensor, lens: Tensor, length: int) -> tuple[Tensor, Tensor]:
        pos = torch.arange(length, device=starts.device)
        pos = torch.where(_valid(lens, length), pos, 0)
        s = starts[seqs][:, None] + pos
        return k_cache[s], v_cache[s]

    return _varlen_attention(query, context_lens, cu_seqlens_q, scale, one, batch)


def _valid(lens: Tensor, length: int) -> Tensor:
    """``[n, length]`` mask of positions below each sequence's length."""
    return torch.arange(length, device=lens.device)[None, :] < lens[:, None]


_OneKV = Callable[[int, int], tuple[Tensor, Tensor]]
_BatchKV = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]


def _varlen_attention(
    query: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
    one: _OneKV,
    batch: _BatchKV,
) -> Tensor:
    """Shared driver: decodes (q_len == 1) in one padded batch, prefill chunks one by one.

    Padding prefill chunks together would multiply work by the longest chunk (a 2k-token
    chunk next to 5-token ones), so chunks run unpadded; a step holds few of them.
    ``one(b, ctx)`` returns sequence ``b``'s ``[ctx, Hkv, D]`` K and V; ``batch(seqs, lens,
    length)`` returns ``[n, length, Hkv, D]`` K and V for several sequences.
    """
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(ctx))]
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    if decodes:
        seqs = torch.tensor(decodes, device=query.device)
        rows = torch.tensor([cu[b] for b in decodes], device=query.device)
        lens = context_lens[seqs]
        k, v = batch(seqs, lens, max(ctx[b] for b in decodes))
        out[rows] = _decode(query[rows], k, v, lens, scale).to(query.dtype)
    for b, n in enumerate(q_lens):
        if n > 1:
            k, v = one(b, ctx[b])
            out[cu[b] : cu[b + 1]] = _prefill(query[cu[b] : cu[b + 1]], k, v, scale).to(
                query.dtype
            )
    return out


def _decode(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, scale: float) -> Tensor:
    """q ``[n, Hq, D]``, k/v ``[n, L, Hkv, D]`` -> ``[n, Hq, D]`` float32."""
    n, hq, d = q.shape
    hkv = k.shape[2]
    # The group's query heads become rows of one [Hkv] problem: no K/V repeat for GQA.
    qg = q.float().view(n, hkv, hq // hkv, d)
    mask = _valid(lens, k.shape[1])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        qg, k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask, scale=scale
    )
    return o.reshape(n, hq, d)


def _prefill(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q ``[Q, Hq, D]``, k/v ``[L, Hkv, D]`` (L >= Q, queries are the last Q positions) ->
    ``[Q, Hq, D]`` float32, causal."""
    nq, hq, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    qg = q.float().view(nq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * nq, d)
    q_pos = torch.arange(length - nq, length, device=q.device)
    causal = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(
        qg,
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=causal.repeat(group, 1)[None],
        scale=scale,
    )
    return o.view(hkv, group, nq, d).permute(2, 0, 1, 3).reshape(nq, hq, d)
