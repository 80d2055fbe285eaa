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
- ``plan``: what the backend's ``plan_paged`` (``plan_contiguous``) returned for the same
  tables (extents), lengths, queries and window: host-side work done once per step and reused by
  every layer. None plans in the call. The Triton kernels read the tables on the device and
  need no plan (their backend has no planners; they accept ``plan=None``).

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
causal square of their own positions. Both layouts go through the same planning
(:mod:`kvbench.kernels.reference_plan`), so neither pays a copy the other does not. On other
devices, where the reference is only the
Triton kernels' oracle, the same plan runs on explicit matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence

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
from kvbench.kernels.reference_plan import (
    AttentionPlan,
    Gather,
    Piece,
    SeqPlan,
    Shared,
    ShortDecodes,
    advance,
    extent_runs,
    make_plan,
    paged_runs,
    slot_bytes,
)
from kvbench.kernels.slot_copy import SlotCopy


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



def plan_paged(
    block_tables: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    block_size: int,
    k_cache: Tensor,
    v_cache: Tensor,
    num_heads: int,
    *,
    positions: bool = False,
    window: int | None = None,
    previous: AttentionPlan | None = None,
) -> AttentionPlan:
    """The plan :func:`paged_attention` follows for these tables, lengths and queries
    (``num_heads`` per row) over caches shaped like ``k_cache`` and ``v_cache``, to pass as its
    ``plan`` in every layer of a step; ``positions``: the calls get ``slot_positions``;
    ``window``: their sliding window; ``previous``: the plan of the step before, carried on
    where that gives the same plan (decodes one key further, see ``advance``)."""
    check_window(window, positions)
    if previous is not None:
        carried = advance(previous, block_tables.cpu().numpy(),
                          context_lens.cpu().numpy().astype(np.int64), cu_seqlens_q)
        if carried is not None and _made_for(carried, k_cache, v_cache, positions, window):
            return carried
    runs = paged_runs(block_tables, context_lens, block_size)
    return make_plan(runs, cu_seqlens_q, k_cache, v_cache, num_heads, positions, window)


def plan_contiguous(
    extent_starts: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    num_heads: int,
    *,
    positions: bool = False,
    window: int | None = None,
    previous: AttentionPlan | None = None,
) -> AttentionPlan:
    """The plan :func:`contiguous_attention` follows (see :func:`plan_paged`)."""
    check_window(window, positions)
    if previous is not None:
        carried = advance(previous, extent_starts.cpu().numpy().astype(np.int64),
                          context_lens.cpu().numpy().astype(np.int64), cu_seqlens_q)
        if carried is not None and _made_for(carried, k_cache, v_cache, positions, window):
            return carried
    runs = extent_runs(extent_starts, context_lens)
    return make_plan(runs, cu_seqlens_q, k_cache, v_cache, num_heads, positions, window)


def _made_for(plan: AttentionPlan, k_cache: Tensor, v_cache: Tensor, positions: bool,
              window: int | None) -> bool:
    """Whether ``plan`` was made for caches of this shape and these options."""
    return (plan.num_slots, plan.row_bytes, plan.positions, plan.window) == (
        k_cache.shape[0], slot_bytes(k_cache) + slot_bytes(v_cache), positions, window)


def check_window(window: int | None, positions: bool) -> None:
    """Refuse a sliding window the kernels cannot apply (``positions``: the call passes
    ``slot_positions``)."""
    if window is None:
        return
    if window < 1:
        raise KvbenchError(f"a sliding window must be at least 1 position, not {window}")
    if positions:
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
    plan: AttentionPlan | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Varlen attention reading each sequence's KV through its block table."""
    if plan is None:
        plan = plan_paged(block_tables, context_lens, cu_seqlens_q, block_size, k_cache,
                          v_cache, query.shape[1], positions=slot_positions is not None,
                          window=window)
    return _Attention(
        query, k_cache, v_cache, scale, k_scale, v_scale, slot_positions, query_positions, window
    ).run(plan, return_lse)


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
    plan: AttentionPlan | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Varlen attention reading each sequence's KV from its contiguous extent."""
    if plan is None:
        plan = plan_contiguous(extent_starts, context_lens, cu_seqlens_q, k_cache, v_cache,
                               query.shape[1], positions=slot_positions is not None,
                               window=window)
    return _Attention(
        query, k_cache, v_cache, scale, k_scale, v_scale, slot_positions, query_positions, window
    ).run(plan, return_lse)


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
        window: int | None,
    ) -> None:
        if (slot_positions is None) != (query_positions is None):
            raise KvbenchError("slot_positions and query_positions go together")
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
        # Decodes over one slice of keys in the query's dtype go straight to the fused CPU
        # kernel (see ``decode``).
        self.direct = native and slot_positions is None and query.device.type == "cpu"
        self.group_size = query.shape[1] // k_cache.shape[1]
        # One layer of a pool [layers, 2, slots, ...]: its V lies right after its K, so a
        # gather reads both in one copy (``pair_units``) from this view of the two.
        self.pair: Tensor | None = None
        if (k_scale is None and v_scale is None and k_cache.dtype == v_cache.dtype
                and k_cache.shape == v_cache.shape and k_cache.is_contiguous()
                and v_cache.is_contiguous()
                and v_cache.data_ptr() == k_cache.data_ptr() + k_cache.nbytes):
            self.pair = _bytes(torch.as_strided(
                k_cache, (2 * k_cache.shape[0], *k_cache.shape[1:]), k_cache.stride()))
        # The plan's shared gather and its K and V, copied once per call (see ``run``).
        self.shared: Gather | None = None
        self.shared_kv: tuple[Tensor, Tensor] | None = None

    def _check(self, plan: AttentionPlan) -> None:
        row_bytes = slot_bytes(self.k_cache) + slot_bytes(self.v_cache)
        made_for = (plan.num_rows, plan.num_slots, plan.row_bytes, plan.positions, plan.window)
        given = (self.query.shape[0], self.k_cache.shape[0], row_bytes,
                 self.slot_positions is not None, self.window)
        if made_for != given:
            raise KvbenchError(
                "attention plan made for (rows, slots, row bytes, key positions, window) "
                f"{made_for}, used with {given}"
            )

    def run(self, plan: AttentionPlan, return_lse: bool) -> Tensor | tuple[Tensor, Tensor]:
        self._check(plan)
        if plan.shared is not None:
            self.shared = plan.shared
            self.shared_kv = self._load_kv(plan.shared)
        query = self.query
        hq = query.shape[1]
        # Sequences' rows are back to back: each output goes to its rows of one tensor.
        out = torch.empty(query.shape, dtype=self.dtype, device=query.device)
        lse_out = torch.empty(query.shape[:2], device=query.device) if return_lse else None
        batched: set[int] = set()
        if plan.short is not None:
            o, lse = self.short_decodes(plan.short)
            out[plan.short.rows] = o
            if lse_out is not None:
                lse_out[plan.short.rows] = lse
            batched.update(plan.short.seqs)
        direct: list[tuple[int, tuple[int, int] | Shared]] = []
        for i, sp in enumerate(plan.seqs):
            if i in batched:
                continue
            if (self.direct and sp.q1 - sp.q0 == 1 and len(sp.pieces) == 1
                    and not isinstance(sp.pieces[0][0], Gather)):
                direct.append((sp.q0, sp.pieces[0][0]))  # type: ignore[arg-type]
                continue
            if sp.pieces and sp.windowed:
                o, lse = self.windowed_chunk(sp)
            elif sp.pieces:
                o, lse = self.sequence(sp)
            else:
                o = torch.zeros(sp.q1 - sp.q0, hq, query.shape[2], dtype=self.dtype,
                                device=query.device)
                lse = torch.full((sp.q1 - sp.q0, hq), float("-inf"), device=query.device)
            out[sp.q0 : sp.q1] = o
            if lse_out is not None:
                lse_out[sp.q0 : sp.q1] = lse
        if direct:
            index = torch.tensor([row for row, _ in direct])
            o, lse = self.decodes(direct)
            out.index_copy_(0, index, o)
            if lse_out is not None:
                lse_out.index_copy_(0, index, lse)
        out = out if out.dtype == query.dtype else out.to(query.dtype)
        return (out, lse_out) if lse_out is not None else out

    def decodes(self, items: list[tuple[int, tuple[int, int] | Shared]]
                ) -> tuple[Tensor, Tensor]:
        """Decodes (query row, its one piece: a slice of the cache or of the shared gather),
        each a call of the fused CPU kernel on views and no other op per decode: outputs
        ``[n, Hq, D]`` and log-sum-exps ``[n, Hq]`` in ``items``' order (see ``direct``)."""
        hkv, d = self.k_cache.shape[1], self.k_cache.shape[2]
        q = self.query.view(-1, hkv, self.group_size, d)
        # [1, Hkv, keys, D] views of the cache and of the shared gather, sliced per decode.
        cache = shared = None
        outs, lses = [], []
        for row, piece in items:
            if isinstance(piece, Shared):
                if shared is None:
                    assert self.shared_kv is not None
                    shared = [x.transpose(0, 1)[None] for x in self.shared_kv]
                (k, v), a, n = shared, piece.start, piece.length
            else:
                if cache is None:
                    cache = [x.transpose(0, 1)[None] for x in (self.k_cache, self.v_cache)]
                (k, v), (a, n) = cache, piece
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[row : row + 1], k[:, :, a : a + n], v[:, :, a : a + n], 0.0, False,
                scale=self.scale)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs).reshape(len(items), -1, d), torch.cat(lses).reshape(len(items), -1)

    def short_decodes(self, batch: ShortDecodes) -> tuple[Tensor, Tensor]:
        """Short decodes in one call over a ``[n, m * unit, Hkv, D]`` copy of their keys' units,
        padding masked."""
        visible, rows = batch.visible, batch.rows
        needs_slots = self.k_scale is not None or self.slot_positions is not None
        slots = batch.token_slots() if needs_slots else None
        if self.query_positions is not None:
            assert self.slot_positions is not None and slots is not None
            visible = visible & (self.slot_positions[slots] <= self.query_positions[rows][:, None])
        if self.pair is not None:
            k, v = (self._as_compute(half.view(batch.units.shape[0], -1, *half.shape[1:]))
                    for half in self._pair_units(batch.unit, batch.pair_units))
        else:
            k, v = (
                self._units(cache, scale, group, batch, slots)
                for cache, scale, group in ((self.k_cache, self.k_scale, self.k_group),
                                            (self.v_cache, self.v_scale, self.v_group))
            )
        if self.query_positions is not None:
            # Whole units are read, beyond a sequence's own pages: in a pool whose page
            # classes share bytes those slots may hold another class's codes, NaN in this
            # dtype, which a -inf mask alone would not keep out (0 x NaN): zero them.
            hidden = ~visible[:, :, None, None]
            k, v = k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)
        n, hq, d = len(batch.seqs), self.query.shape[1], self.query.shape[2]
        q = self.query[rows].to(self.dtype).view(n, -1, self.group_size, d)
        if self.query_positions is None:
            mask = batch.mask if batch.mask.dtype == self.dtype else batch.mask.to(self.dtype)
        else:
            mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(
                ~visible, float("-inf"))[:, None, None]
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=mask, scale=self.scale,
        )
        lse = lse.reshape(n, hq)
        if self.query_positions is not None:
            # Without key positions every decode of a batch sees at least one key.
            lse = lse.masked_fill(~visible.any(-1, keepdim=True), float("-inf"))
        return o.reshape(n, hq, d), lse

    def _units(self, cache: Tensor, scale: Tensor | None, group: int, batch: ShortDecodes,
               slots: Tensor | None) -> Tensor:
        """``cache`` at the units of ``batch``, as ``[n, m * unit, Hkv, D]`` of the compute
        dtype (``slots``: the batch's token slots, needed with scales)."""
        raw = _bytes(cache)
        # Rows of whole units index faster flat than as [units, unit, Hkv, D].
        flat = raw.view(-1, batch.unit * raw[0].numel()) if raw.is_contiguous() else (
            raw.unflatten(0, (-1, batch.unit))
        )
        x = flat.index_select(0, batch.units.flatten()).view(cache.dtype)
        x = x.view(batch.units.shape[0], -1, *cache.shape[1:])
        if scale is not None:
            assert slots is not None
            return decode(x, scale[torch.div(slots, group, rounding_mode="floor")][..., None])
        return self._as_compute(x)

    def sequence(self, sp: SeqPlan) -> tuple[Tensor, Tensor]:
        """One sequence's rows over its pieces: ``[nq, Hq, D]`` output, ``[nq, Hq]``
        log-sum-exp."""
        q = self.query[sp.q0 : sp.q1]
        if q.dtype != self.dtype:
            q = q.to(self.dtype)
        outs = [self._attend(q, sp.q0, sp.q1, piece, causal) for piece, causal in sp.pieces]
        if len(outs) == 1:
            return outs[0]
        # All pieces at once: weights from the log-sum-exp of their log-sum-exps.
        o, lse = torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])
        total = torch.logsumexp(lse, 0)
        w = torch.exp(lse - torch.where(total == float("-inf"), 0.0, total))
        return (w[..., None] * o).sum(0), total

    def windowed_chunk(self, sp: SeqPlan) -> tuple[Tensor, Tensor]:
        """A prefill chunk under a sliding window: the keys any of its queries sees, in order,
        in one piece, each query masked to its own window."""
        assert self.window is not None
        ((piece, _),) = sp.pieces
        q = self.query[sp.q0 : sp.q1]
        if q.dtype != self.dtype:
            q = q.to(self.dtype)
        k, v = self._load_kv(piece)
        # Positions relative to the piece's first key: the chunk's queries are its last.
        nk, nq = k.shape[0], q.shape[0]
        k_pos = torch.arange(nk, device=q.device)[None, :]
        q_pos = torch.arange(nk - nq, nk, device=q.device)[:, None]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - self.window)
        if q.device.type == "cpu":
            return self._flash_cpu(q, k, v, visible, False)
        return self._math(q, k, v, visible, False)

    def _as_compute(self, x: Tensor) -> Tensor:
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def _pair_units(self, unit: int, pair_units: Tensor) -> tuple[Tensor, ...]:
        """K's and V's copies of the units of ``unit`` slots in ``pair_units``, read by one
        copy from the pool's K/V pair: two ``[units * unit, Hkv, D]`` in the cache's dtype."""
        assert self.pair is not None
        x = self.pair.view(-1, unit * self.pair[0].numel()).index_select(0, pair_units)
        return x.view(self.k_cache.dtype).view(-1, *self.k_cache.shape[1:]).chunk(2)

    def _load_kv(self, piece: Piece) -> tuple[Tensor, Tensor]:
        """K and V of ``piece`` in the compute dtype; a gather from a pool's K/V pair in one
        copy."""
        if isinstance(piece, Shared):
            assert self.shared_kv is not None
            k, v = self.shared_kv
            return k[piece.start : piece.start + piece.length], v[
                piece.start : piece.start + piece.length]
        if self.pair is not None and isinstance(piece, Gather):
            k, v = (self._as_compute(half[: piece.num_keys])
                    for half in self._pair_units(piece.unit, piece.pair_units))
            return k, v
        return (self._load(self.k_cache, self.k_scale, self.k_group, piece),
                self._load(self.v_cache, self.v_scale, self.v_group, piece))

    def _load(self, cache: Tensor, scale: Tensor | None, group: int, piece: Piece) -> Tensor:
        if isinstance(piece, Gather):
            raw = _bytes(cache)
            # Rows of whole units index faster flat than as [units, unit, Hkv, D].
            units = raw.view(-1, piece.unit * raw[0].numel()) if raw.is_contiguous() else (
                raw.unflatten(0, (-1, piece.unit))
            )
            x = units.index_select(0, piece.units).view(-1, *cache.shape[1:])
            x = x[: piece.num_keys].view(cache.dtype)
            slots = piece.token_slots
        else:
            x = cache[piece[0] : piece[0] + piece[1]]
            slots = None
            if scale is not None:
                slots = torch.arange(piece[0], piece[0] + piece[1], device=cache.device)
        if scale is not None:
            assert slots is not None
            return decode(x, scale[torch.div(slots, group, rounding_mode="floor")][:, :, None])
        return self._as_compute(x)

    def _key_positions(self, piece: Piece) -> Tensor:
        assert self.slot_positions is not None
        if isinstance(piece, Shared):
            assert self.shared is not None
            return self.slot_positions[
                self.shared.token_slots[piece.start : piece.start + piece.length]]
        if isinstance(piece, Gather):
            return self.slot_positions[piece.token_slots]
        return self.slot_positions[piece[0] : piece[0] + piece[1]]

    def _attend(
        self, q: Tensor, q0: int, q1: int, piece: Piece, causal: bool
    ) -> tuple[Tensor, Tensor]:
        k, v = self._load_kv(piece)
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
