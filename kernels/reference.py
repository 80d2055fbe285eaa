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

Optional keyword arguments, the same for every backend:

- ``k_scale``, ``v_scale``: float32 ``[S // group, num_kv_heads]`` scales of an ``int8`` or
  ``float8_e4m3fn`` cache (see :mod:`kvbench.kernels.quant`); None for a float cache.
- ``slot_positions`` ``[S]`` int32 and ``query_positions`` ``[T]`` int32, together: a pool that
  holds only some of a sequence's positions (one page class of several). Sequence ``b``'s keys
  are then its first ``context_len`` slots in table (extent) order, and query ``t`` sees key
  slot ``s`` iff ``slot_positions[s] <= query_positions[t]``. The executor writes
  ``slot_positions[slot_mapping] = positions`` once per step for all layers.
- ``window``: sliding-window attention (None: none): the query at position ``q`` sees only
  positions ``q - window + 1 .. q``. Blocks wholly before every query's window may have been
  freed and reused: kernels do not read them (or read and mask them). Not with
  ``slot_positions``.
- ``return_lse``: also return the log-sum-exp (natural log) of each query row's scaled scores,
  ``[T, num_heads]`` float32, ``-inf`` for a row that sees no key (its output is 0).
  :func:`merge_attention` combines outputs over disjoint key sets with it.

Attention accumulates in float32 (a float cache in the query's dtype is read as is, with
float32 accumulation) and returns ``query``'s dtype. Kernels read only up to ``context_len``.

The CPU path reads KV in place: a sequence's KV is a list of runs of physically consecutive
slots (one extent; a fresh pool's consecutive blocks; a recycled pool's descending ones,
joined where order does not matter), each attended as a strided view of the cache with no
copy by torch's fused CPU attention, and runs are combined by their log-sum-exp. Runs too
short to be worth a call of their own (scattered blocks) are gathered together into one
copy. Sequences run one by one, so unequal lengths cost no padding, except short decodes
(a few hundred KiB of K+V), which share one call over a padded copy: a call each would cost
more. Prefill chunks split their keys into the part every query sees (no mask) and the
causal square of their own positions. Both layouts go through the same plan, so neither pays
a copy the other does not. The plan is made on the host from the block tables and lengths;
on CPU reading them is no device sync. On other devices, where the reference is only the
Triton kernels' oracle, the same plan runs on explicit matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvbench.errors import KvbenchError
from kvbench.kernels.quant import (
    check_aligned,
    copy_group,
    decode,
    encode,
    plan_scales,
    scale_group,
    to_codes,
)
from kvbench.kernels.slot_copy import SlotCopy

# A run is attended in place when its K+V bytes exceed this plus MERGE_COST times the bytes
# of the partial output it adds to the merge; shorter runs are cheaper to gather together
# (scattered blocks). Measured on one core: a call and its share of the merge cost about as
# much as copying a megabyte, and a merge passes over its outputs a few times.
MIN_VIEW_BYTES = 2**20
MERGE_COST = 4
# Decodes whose K+V take at most this many bytes are attended together, in one call over a
# padded copy of their keys: a call per sequence costs more than copying this little (and
# padding wastes at most this much per sequence). Both layouts take this path alike.
SHORT_DECODE_BYTES = 256 * 2**10


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
    _store(k_cache, key, slot_mapping, k_scale, scale_group(k_cache, k_scale, "k_scale"))
    _store(v_cache, value, slot_mapping, v_scale, scale_group(v_cache, v_scale, "v_scale"))


def _store(cache: Tensor, x: Tensor, slot_mapping: Tensor, scale: Tensor | None,
           group: int) -> None:
    if scale is None:
        cache.index_copy_(0, slot_mapping, x)
        return
    if x.shape[0] == 0:
        return
    plan = plan_scales(scale, x, slot_mapping, group, cache.dtype)
    codes = _bytes(cache)
    if plan.requantise.any():
        # The codes written so far: the group's slots before this store's first one.
        first = plan.slots[plan.requantise]
        counts = first % group
        rows = torch.repeat_interleave(first - counts, counts)
        rows += torch.arange(rows.shape[0]) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        ratio = torch.repeat_interleave(plan.ratio[plan.requantise], counts, dim=0)
        old = codes.index_select(0, rows).view(cache.dtype)
        codes.index_copy_(0, rows, _bytes(to_codes(decode(old, ratio[:, :, None]), cache.dtype)))
    scale[plan.groups] = plan.new
    new = encode(x[plan.order].float(), plan.new[:, :, None], cache.dtype)
    codes.index_copy_(0, plan.slots, _bytes(new))


def _bytes(t: Tensor) -> Tensor:
    """Codes as raw bytes: indexing ops do not all take float8 tensors."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def copy_slots(
    caches: Tensor, copies: Sequence[SlotCopy], scales: Tensor | None = None
) -> None:
    """Apply slot-range copies, in order, to every cache at once.

    ``caches`` is ``[num_caches, S, ...]`` (the executor passes all layers' K and V as one
    view); ``scales``, for a quantised pool, is ``[num_caches, S // group, ...]`` and its groups
    move with their slots. Each copy behaves as if read through a temporary, so overlapping
    ranges (a compaction sliding an extent left) are correct.
    """
    data = _bytes(caches)
    group = 0
    if scales is not None:
        group = copy_group(caches, scales)
        for c in copies:
            check_aligned(c, group)
    for c in copies:
        _copy_range(data, c.src, c.dst, c.num_slots)
        if scales is not None:
            _copy_range(scales, c.src // group, c.dst // group, -(-c.num_slots // group))


def _copy_range(t: Tensor, src: int, dst: int, n: int) -> None:
    piece = t[:, src : src + n]
    if abs(src - dst) < n:
        piece = piece.clone()
    t[:, dst : dst + n] = piece


def merge_attention(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *, return_lse: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets from each set's output ``[T, H, D]``
    and log-sum-exp ``[T, H]`` float32; the result has ``out_a``'s dtype."""
    m = torch.maximum(lse_a, lse_b)
    # Rows that see no key in either set keep lse -inf; shift them by 0, not by -inf.
    m = torch.where(m == float("-inf"), 0.0, m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    out = (out_a.float() * w_a[..., None] + out_b.float() * w_b[..., None]) / torch.where(
        total > 0, total, 1.0
    )[..., None]
    out = out.to(out_a.dtype)
    return (out, m + torch.log(total)) if return_lse else out


@dataclass(frozen=True, slots=True)
class _Runs:
    """Where each sequence's keys lie: ``segs[:, ptr[b] : ptr[b + 1]]`` are sequence ``b``'s
    runs, rows (first slot, first key index, length): physically consecutive slots holding
    keys ``key .. key + length - 1`` in order."""

    ptr: list[int]
    segs: np.ndarray
    context: list[int]


def _paged_runs(block_tables: Tensor, context_lens: Tensor, block_size: int) -> _Runs:
    ctx = context_lens.cpu().numpy().astype(np.int64)
    num_blocks = -(-ctx // block_size)
    width = int(num_blocks.max(initial=0))
    tables = block_tables[:, :width].cpu().numpy().astype(np.int64)
    seq, col = np.nonzero(np.arange(width)[None, :] < num_blocks[:, None])
    block = tables[seq, col]
    starts = np.ones(len(block), dtype=bool)
    starts[1:] = (seq[1:] != seq[:-1]) | (block[1:] != block[:-1] + 1)
    first = np.flatnonzero(starts)
    run_seq, key = seq[first], col[first] * block_size
    length = np.diff(np.append(first, len(block))) * block_size
    length = np.minimum(length, ctx[run_seq] - key)
    ptr = np.searchsorted(run_seq, np.arange(len(ctx) + 1))
    return _Runs(ptr.tolist(), np.stack([block[first] * block_size, key, length]), ctx.tolist())


def _extent_runs(extent_starts: Tensor, context_lens: Tensor) -> _Runs:
    ctx = context_lens.cpu().numpy().astype(np.int64)
    starts = extent_starts.cpu().numpy().astype(np.int64)
    return _Runs(list(range(len(ctx) + 1)), np.stack([starts, np.zeros_like(ctx), ctx]),
                 ctx.tolist())


def check_window(window: int | None, slot_positions: Tensor | None) -> None:
    """Refuse a sliding window the kernels cannot apply."""
    if window is None:
        return
    if window < 1:
        raise KvbenchError(f"a sliding window must be at least 1 position, not {window}")
    if slot_positions is not None:
        raise KvbenchError(
            "a sliding window over a pool holding part of a sequence (slot_positions) is not "
            "supported"
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
) -> Tensor | tuple[Tensor, Tensor]:
    """Varlen attention reading each sequence's KV through its block table."""
    runs = _paged_runs(block_tables, context_lens, block_size)
    return _Attention(
        query, k_cache, v_cache, scale, k_scale, v_scale, slot_positions, query_positions,
        window,
    ).run(runs, cu_seqlens_q, return_lse)


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
) -> Tensor | tuple[Tensor, Tensor]:
    """Varlen attention reading each sequence's KV from its contiguous extent."""
    runs = _extent_runs(extent_starts, context_lens)
    return _Attention(
        query, k_cache, v_cache, scale, k_scale, v_scale, slot_positions, query_positions,
        window,
    ).run(runs, cu_seqlens_q, return_lse)


def _window_decodes(runs: _Runs, cu: list[int], window: int) -> _Runs:
    """``runs`` with each decode's keys cut to the last ``window`` and renumbered from 0, so
    that a decode needs no mask; prefill chunks keep theirs (they are masked)."""
    ptr, parts, context = [0], [], []
    for b, ctx in enumerate(runs.context):
        segs = runs.segs[:, runs.ptr[b] : runs.ptr[b + 1]]
        if cu[b + 1] - cu[b] == 1 and ctx > window:
            segs = _clip(segs, ctx - window, ctx)
            segs[1] -= ctx - window
            ctx = window
        parts.append(segs)
        ptr.append(ptr[-1] + segs.shape[1])
        context.append(ctx)
    return _Runs(ptr, np.concatenate(parts, axis=1), context)


def _clip(segs: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The parts of runs ``segs`` holding keys ``lo .. hi - 1``."""
    slot, key, n = segs
    a, b = np.maximum(key, lo), np.minimum(key + n, hi)
    keep = b > a
    return np.stack([slot + a - key, a, b - a])[:, keep]


def _coalesce(segs: np.ndarray) -> np.ndarray:
    """Runs whose order does not matter (no causal mask among them) sorted by slot and
    joined where one ends at the next's start: a pool recycles a sequence's blocks tail
    first, so later sequences get descending runs of blocks, one range of slots each. The
    joined runs' key indices are no longer meaningful."""
    if segs.shape[1] < 2:
        return segs
    segs = segs[:, np.argsort(segs[0], kind="stable")]
    slot, n = segs[0], segs[2]
    start = np.ones(len(slot), dtype=bool)
    start[1:] = slot[1:] != slot[:-1] + n[:-1]
    first = np.flatnonzero(start)
    return np.stack([slot[first], segs[1][first], np.add.reduceat(n, first)])


@dataclass(frozen=True, slots=True)
class _Gather:
    """Short runs (first slots, lengths) copied together, in order, as ``units`` of ``unit``
    slots each; the last run may end inside its last unit, whose tail is dropped."""

    slots: np.ndarray
    lengths: np.ndarray
    unit: int
    units: Tensor

    def token_slots(self, device: torch.device) -> Tensor:
        ends = np.cumsum(self.lengths)
        tokens = np.arange(ends[-1]) + np.repeat(self.slots - (ends - self.lengths), self.lengths)
        return torch.from_numpy(tokens).to(device)


# A piece of one sequence's keys: a slice (first slot, length) read in place, or a gather.
_Piece = tuple[int, int] | _Gather


class _Attention:
    """One attention call: the cache, its scales and masks, and how pieces are attended."""

    def __init__(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        scale: float,
        k_scale: Tensor | None,
        v_scale: Tensor | None,
        slot_positions: Tensor | None,
        query_positions: Tensor | None,
        window: int | None = None,
    ) -> None:
        if (slot_positions is None) != (query_positions is None):
            raise KvbenchError("slot_positions and query_positions go together")
        check_window(window, slot_positions)
        self.window = window
        self.query, self.k_cache, self.v_cache, self.scale = query, k_cache, v_cache, scale
        self.k_scale, self.v_scale = k_scale, v_scale
        self.k_group = scale_group(k_cache, k_scale, "k_scale")
        self.v_group = scale_group(v_cache, v_scale, "v_scale")
        self.slot_positions, self.query_positions = slot_positions, query_positions
        # A float cache in the query's dtype is read in place; codes or other floats are
        # turned into float32 piece by piece.
        native = k_scale is None and k_cache.dtype == v_cache.dtype == query.dtype
        self.dtype = query.dtype if native else torch.float32
        self.row_bytes = k_cache[0].nbytes + v_cache[0].nbytes
        self.group_size = query.shape[1] // k_cache.shape[1]

    def run(
        self, runs: _Runs, cu_seqlens_q: Tensor, return_lse: bool
    ) -> Tensor | tuple[Tensor, Tensor]:
        query = self.query
        cu = cu_seqlens_q.tolist()
        num_seqs = len(cu) - 1
        if self.window is not None and num_seqs:
            runs = _window_decodes(runs, cu, self.window)
        done: dict[int, tuple[Tensor, Tensor]] = {}
        short = [
            b for b in range(num_seqs)
            if cu[b + 1] - cu[b] == 1 and runs.ptr[b + 1] > runs.ptr[b]
            and 0 < runs.context[b] * self.row_bytes <= SHORT_DECODE_BYTES
        ]
        if len(short) > 1 and query.device.type == "cpu":
            o, lse = self.short_decodes(short, cu, runs)
            done = {b: (o[i : i + 1], lse[i : i + 1]) for i, b in enumerate(short)}
        # Sequences' rows are back to back: their outputs are concatenated, in one copy.
        outs, lses = [], []
        for b in range(num_seqs):
            q0, q1 = cu[b], cu[b + 1]
            p0, p1 = runs.ptr[b], runs.ptr[b + 1]
            if q1 == q0:
                continue
            if b in done:
                o, lse = done[b]
            elif p1 == p0 or runs.context[b] == 0:
                o = query.new_zeros(q1 - q0, *query.shape[1:])
                lse = torch.full((q1 - q0, query.shape[1]), float("-inf"), device=query.device)
            elif self.window is not None and q1 - q0 > 1:
                o, lse = self.windowed_chunk(q0, q1, runs.segs[:, p0:p1], runs.context[b])
            else:
                o, lse = self.sequence(q0, q1, runs.segs[:, p0:p1], runs.context[b])
            outs.append(o)
            lses.append(lse)
        if not outs:
            empty = torch.empty(0, query.shape[1], device=query.device)
            return (torch.zeros_like(query), empty) if return_lse else torch.zeros_like(query)
        out = torch.cat(outs).to(query.dtype)
        return (out, torch.cat(lses)) if return_lse else out

    def short_decodes(self, seqs: list[int], cu: list[int], runs: _Runs
                      ) -> tuple[Tensor, Tensor]:
        """Decodes of sequences ``seqs`` in one call over a ``[n, longest, Hkv, D]`` copy of
        their keys, padding masked; padding repeats each sequence's first key, a finite
        value, since masked probabilities still multiply what they mask."""
        first = np.array([runs.ptr[b] for b in seqs])
        counts = np.array([runs.ptr[b + 1] for b in seqs]) - first
        ends = np.cumsum(counts)
        picked = np.arange(ends[-1]) + np.repeat(first - (ends - counts), counts)
        slot, key, length = runs.segs[:, picked]
        owner = np.repeat(np.arange(len(seqs)), counts)
        lens = np.array([runs.context[b] for b in seqs])
        tok_ends = np.cumsum(length)
        offset = np.arange(tok_ends[-1]) - np.repeat(tok_ends - length, length)
        slots = np.repeat(slot[ends - counts], lens.max()).reshape(len(seqs), -1)
        slots[np.repeat(owner, length), np.repeat(key, length) + offset] = (
            np.repeat(slot, length) + offset
        )
        index = torch.from_numpy(slots)
        visible = torch.from_numpy(np.arange(slots.shape[1])[None, :] < lens[:, None])
        rows = torch.tensor([cu[b] for b in seqs])
        if self.query_positions is not None:
            assert self.slot_positions is not None
            visible &= self.slot_positions[index] <= self.query_positions[rows][:, None]
        k, v = (
            self._rows(cache, scale, group, index)
            for cache, scale, group in ((self.k_cache, self.k_scale, self.k_group),
                                        (self.v_cache, self.v_scale, self.v_group))
        )
        n, hq, d = len(seqs), self.query.shape[1], self.query.shape[2]
        q = self.query[rows].to(self.dtype).view(n, -1, self.group_size, d)
        mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.transpose(1, 2), v.transpose(1, 2), 0.0, False,
            attn_mask=mask[:, None, None], scale=self.scale,
        )
        lse = lse.reshape(n, hq).masked_fill(~visible.any(-1, keepdim=True), float("-inf"))
        return o.reshape(n, hq, d), lse

    def _rows(self, cache: Tensor, scale: Tensor | None, group: int, index: Tensor) -> Tensor:
        """``cache`` at slots ``index`` ``[n, L]``, as ``[n, L, Hkv, D]`` of the compute dtype."""
        raw = _bytes(cache)
        # Rows of all heads index faster flat than as [S, Hkv, D].
        flat = raw.view(raw.shape[0], -1) if raw.is_contiguous() else raw
        x = flat.index_select(0, index.flatten()).view(cache.dtype)
        x = x.view(*index.shape, *cache.shape[1:])
        if scale is not None:
            return decode(x, scale[torch.div(index, group, rounding_mode="floor")][..., None])
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def sequence(self, q0: int, q1: int, segs: np.ndarray, ctx: int) -> tuple[Tensor, Tensor]:
        """Sequence rows ``q0 : q1`` over its key runs: ``[nq, Hq, D]`` output, ``[nq, Hq]``
        log-sum-exp."""
        q = self.query[q0:q1]
        if q.dtype != self.dtype:
            q = q.to(self.dtype)
        nq = q1 - q0
        if self.query_positions is not None or nq == 1:
            parts = [(_coalesce(segs), False)]
        else:
            # Keys before the chunk are seen by every query; the chunk's own keys form a
            # causal square.
            split = ctx - nq
            parts = [(_coalesce(_clip(segs, 0, split)), False), (_clip(segs, split, ctx), True)]
        outs = [
            self._attend(q, q0, q1, piece, causal)
            for part, causal in parts
            for piece in self._pieces(part, nq, causal)
        ]
        if len(outs) == 1:
            return outs[0]
        # All pieces at once: weights from the log-sum-exp of their log-sum-exps.
        o, lse = torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])
        total = torch.logsumexp(lse, 0)
        w = torch.exp(lse - torch.where(total == float("-inf"), 0.0, total))
        return (w[..., None] * o).sum(0), total

    def windowed_chunk(self, q0: int, q1: int, segs: np.ndarray, ctx: int
                       ) -> tuple[Tensor, Tensor]:
        """A prefill chunk under a sliding window: the keys any of its queries sees, in
        order, in one piece, each query masked to its own window."""
        assert self.window is not None
        q = self.query[q0:q1]
        if q.dtype != self.dtype:
            q = q.to(self.dtype)
        nq = q1 - q0
        lo = max(ctx - nq - self.window + 1, 0)
        segs = _clip(segs, lo, ctx)
        piece: _Piece = (int(segs[0, 0]), int(segs[2, 0])) if segs.shape[1] == 1 else (
            self._gather(segs[0], segs[2], in_order=True))
        k = self._load(self.k_cache, self.k_scale, self.k_group, piece)
        v = self._load(self.v_cache, self.v_scale, self.v_group, piece)
        k_pos = torch.arange(lo, ctx, device=q.device)[None, :]
        q_pos = torch.arange(ctx - nq, ctx, device=q.device)[:, None]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - self.window)
        if q.device.type == "cpu":
            return self._flash_cpu(q, k, v, visible, False)
        return self._math(q, k, v, visible, False)

    def _pieces(self, segs: np.ndarray, nq: int, causal: bool) -> list[_Piece]:
        """Runs long enough to attend on their own as slices, the others gathered together;
        a ``causal`` part (a chunk's own keys) is one piece with its keys in order."""
        if segs.shape[1] == 1:
            return [(int(segs[0, 0]), int(segs[2, 0]))]
        out_bytes = nq * self.query[0].numel() * 4
        long = segs[2] * self.row_bytes >= MIN_VIEW_BYTES + MERGE_COST * out_bytes
        if causal:
            long[:] = False
        pieces: list[_Piece] = [(int(a), int(n)) for a, n in segs[[0, 2]][:, long].T]
        short = segs[:, ~long]
        if short.shape[1] == 1:
            pieces.append((int(short[0, 0]), int(short[2, 0])))
        elif short.shape[1]:
            pieces.append(self._gather(short[0], short[2], in_order=causal))
        return pieces

    def _gather(self, slots: np.ndarray, lengths: np.ndarray, in_order: bool) -> _Gather:
        # Copy in the largest units that the runs allow (whole blocks, as a rule): indexing
        # long rows is several times faster than indexing single tokens. Only the last run
        # may end inside a unit, so where order is free a partial block (a sequence's last,
        # anywhere once runs are sorted by slot) goes last.
        num_slots = self.k_cache.shape[0]
        unit = int(np.gcd.reduce(np.append(slots, num_slots)))
        if not in_order:
            last = np.argsort(lengths % unit != 0, kind="stable")
            slots, lengths = slots[last], lengths[last]
        unit = int(np.gcd.reduce(np.append(lengths[:-1], unit)))
        counts = -(-lengths // unit)
        ends = np.cumsum(counts)
        ids = np.arange(ends[-1]) + np.repeat(slots // unit - (ends - counts), counts)
        return _Gather(slots, lengths, unit, torch.from_numpy(ids).to(self.query.device))

    def _load(self, cache: Tensor, scale: Tensor | None, group: int, piece: _Piece) -> Tensor:
        if isinstance(piece, _Gather):
            raw = _bytes(cache)
            # Rows of whole units index faster flat than as [units, unit, Hkv, D].
            units = raw.view(-1, piece.unit * raw[0].numel()) if raw.is_contiguous() else (
                raw.unflatten(0, (-1, piece.unit))
            )
            x = units.index_select(0, piece.units).view(-1, *cache.shape[1:])
            x = x[: int(piece.lengths.sum())].view(cache.dtype)
            slots = piece.token_slots(cache.device) if scale is not None else None
        else:
            x = cache[piece[0] : piece[0] + piece[1]]
            slots = None
            if scale is not None:
                slots = torch.arange(piece[0], piece[0] + piece[1], device=cache.device)
        if scale is not None:
            assert slots is not None
            return decode(x, scale[torch.div(slots, group, rounding_mode="floor")][:, :, None])
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def _key_positions(self, piece: _Piece) -> Tensor:
        assert self.slot_positions is not None
        if isinstance(piece, _Gather):
            return self.slot_positions[piece.token_slots(self.slot_positions.device)]
        return self.slot_positions[piece[0] : piece[0] + piece[1]]

    def _attend(
        self, q: Tensor, q0: int, q1: int, piece: _Piece, causal: bool
    ) -> tuple[Tensor, Tensor]:
        k = self._load(self.k_cache, self.k_scale, self.k_group, piece)
        v = self._load(self.v_cache, self.v_scale, self.v_group, piece)
        visible = None
        if self.query_positions is not None:
            visible = self._key_positions(piece)[None, :] <= self.query_positions[q0:q1, None]
        if q.device.type == "cpu":
            o, lse = self._flash_cpu(q, k, v, visible, causal)
        else:
            o, lse = self._math(q, k, v, visible, causal)
        if visible is not None:
            lse = lse.masked_fill(~visible.any(-1, keepdim=True), float("-inf"))
        return o, lse

    def _flash_cpu(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
                   causal: bool) -> tuple[Tensor, Tensor]:
        """torch's fused CPU attention (the kernel behind SDPA on CPU, which also returns the
        log-sum-exp) on strided views: ``[1, heads, rows, D]``, GQA by head count."""
        nq, hq, d = q.shape
        hkv = k.shape[1]
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
            mask = mask[None, None]
        # One decode query: a KV head's group of query heads as the rows of one problem, so
        # each K/V row is read once; a chunk: the kernel's own GQA by head count.
        q4 = q.view(1, hkv, self.group_size, d) if nq == 1 else q.transpose(0, 1)[None]
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, causal,
            attn_mask=mask, scale=self.scale,
        )
        if nq == 1:
            return o.reshape(1, hq, d), lse.reshape(1, hq)
        return o[0].transpose(0, 1), lse[0].transpose(0, 1)

    def _math(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
              causal: bool) -> tuple[Tensor, Tensor]:
        """Explicit float32 softmax attention, for devices other than the CPU."""
        nq, n = q.shape[0], k.shape[0]
        k = k.float().repeat_interleave(self.group_size, dim=1)
        v = v.float().repeat_interleave(self.group_size, dim=1)
        s = torch.einsum("qhd,khd->hqk", q.float(), k) * self.scale
        if causal:
            visible = torch.ones(nq, n, dtype=torch.bool, device=q.device).tril()
        if visible is not None:
            s = s.masked_fill(~visible[None], float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
        return torch.einsum("hqk,khd->qhd", p, v), lse.T
