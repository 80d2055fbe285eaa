"""The plan of the torch reference attention: where each sequence's keys lie in the cache and
how the reference reads them (slices in place, gathered copies, one padded batch of short
decodes).

A plan depends on the layout (block tables or extents), the context lengths, the split of the
queries into sequences and the cache's shape, never on the cache's contents: one plan serves
every layer of a step. The executor makes it once per step (``KVLayout.plan``) and passes it
to each layer's kernel call, so the host-side work below is not repeated per layer. It is made
on the host from the layout's arrays; on the CPU reading them is no device sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

# A run is attended in place when its K+V bytes exceed this plus MERGE_COST times the bytes
# of the partial output it adds to the merge; shorter runs are cheaper to gather together
# (scattered blocks). Measured on one core: a call and its share of the merge cost about as
# much as copying a megabyte, and a merge passes over its outputs a few times.
MIN_VIEW_BYTES = 2**20
MERGE_COST = 4
# Decodes whose K+V take at most this many bytes are attended together, in one call over a
# padded copy of their keys in whole units (blocks, as a rule): a call per sequence costs more
# than copying this little (and padding wastes at most this much per sequence). Both layouts
# take this path alike. Longer decodes are not batched, not even those whose keys are gathered
# anyway: on one core, the masked call over their padded copy cost about 10% more step time
# than a call each on the mixed-text workload.
SHORT_DECODE_BYTES = 256 * 2**10
FP32 = 4


@dataclass(frozen=True, slots=True)
class Runs:
    """Where each sequence's keys lie: ``segs[:, ptr[b] : ptr[b + 1]]`` are sequence ``b``'s
    runs, rows (first slot, first key index, length): physically consecutive slots holding
    keys ``key .. key + length - 1`` in order. ``layout``: the layout's array they come from
    (the tables' columns in use, or the extents' starts); ``block``: the size of the blocks
    they are made of (None: extents)."""

    ptr: list[int]
    segs: np.ndarray
    context: list[int]
    layout: np.ndarray
    block: int | None


def paged_runs(block_tables: Tensor, context_lens: Tensor, block_size: int) -> Runs:
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
    return Runs(ptr.tolist(), np.stack([block[first] * block_size, key, length]), ctx.tolist(),
                tables, block_size)


def extent_runs(extent_starts: Tensor, context_lens: Tensor) -> Runs:
    ctx = context_lens.cpu().numpy().astype(np.int64)
    starts = extent_starts.cpu().numpy().astype(np.int64)
    return Runs(list(range(len(ctx) + 1)), np.stack([starts, np.zeros_like(ctx), ctx]),
                ctx.tolist(), starts, None)


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
class Gather:
    """Short runs (first slots, lengths) copied together, in order, as ``units`` of ``unit``
    slots each; the last run may end inside its last unit, whose tail is dropped.
    ``token_slots`` are the slots of the copied keys, one each (for scales and key
    positions). ``pair_units``: ``units`` then the same units of a cache of ``num_slots``
    slots stored right after the first (V after K in one pool), read by one copy."""

    num_keys: int
    unit: int
    units: Tensor
    token_slots: Tensor
    pair_units: Tensor


@dataclass(frozen=True, slots=True)
class Shared:
    """Keys ``start .. start + length - 1`` of the plan's shared gather
    (:attr:`AttentionPlan.shared`): the scattered runs of every decode attended on its own,
    copied together by one copy per layer rather than one per decode."""

    start: int
    length: int


# A piece of one sequence's keys: a slice (first slot, length) read in place, a gather of its
# own, or its part of the shared gather.
Piece = tuple[int, int] | Gather | Shared


@dataclass(frozen=True, slots=True)
class SeqPlan:
    """Query rows ``q0 : q1`` of one sequence and the pieces of its keys, each with whether
    the causal mask applies (a prefill chunk's own keys); no pieces: it sees no key (or it is
    in the plan's batch of short decodes). ``windowed``: a prefill chunk under a sliding
    window, one piece of the keys any of its queries sees, in order, each query masked to its
    own window. ``tail``: the index of the piece holding a decode's last key (-1: none
    known), the piece :func:`advance` lengthens."""

    q0: int
    q1: int
    pieces: tuple[tuple[Piece, bool], ...]
    windowed: bool = False
    tail: int = -1


@dataclass(frozen=True, slots=True)
class ShortDecodes:
    """Short decodes attended in one call: ``seqs`` index :attr:`AttentionPlan.seqs`, ``rows`` are
    their query rows ``[n]``; ``units`` ``[n, m]`` the units of ``unit`` slots holding each
    one's keys in key order, padded with its first (a finite value, since masked
    probabilities still multiply what they mask); ``visible`` ``[n, m * unit]`` which copied
    slots are its keys, ``mask`` the same as the fused kernel's float32 additive mask
    ``[n, 1, 1, m * unit]``, made once for every layer."""

    seqs: tuple[int, ...]
    rows: Tensor
    unit: int
    units: Tensor
    visible: Tensor
    mask: Tensor
    pair_units: Tensor  # as Gather.pair_units, flat: [2 * n * m]

    def token_slots(self) -> Tensor:
        """The slot of every copied key, ``[n, m * unit]`` (for scales and key positions)."""
        offsets = torch.arange(self.unit, device=self.units.device)
        return (self.units[..., None] * self.unit + offsets).flatten(1)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one step's attention reads the cache; the shape facts it was made for are checked
    by the kernels that reuse it."""

    num_rows: int
    num_slots: int
    row_bytes: int
    positions: bool
    window: int | None
    seqs: tuple[SeqPlan, ...]
    short: ShortDecodes | None
    shared: Gather | None = None
    source: Source | None = None


@dataclass(frozen=True, slots=True)
class Source:
    """What a plan of decodes was made from: the layout's array (:attr:`Runs.layout`) and the
    context lengths; ``steps``: for how many steps of one more key per decode :func:`advance`
    can carry it on, each time giving the plan that planning afresh gives."""

    layout: np.ndarray
    context: np.ndarray
    steps: int


def make_plan(runs: Runs, cu_seqlens_q: Tensor, k_cache: Tensor, v_cache: Tensor,
              num_heads: int, positions: bool, window: int | None = None) -> AttentionPlan:
    """The plan of ``runs`` for queries split by ``cu_seqlens_q`` (``num_heads`` per row),
    over caches shaped like ``k_cache`` and ``v_cache``; ``positions``: the kernels get key
    and query positions (one page class of several), which mask every piece; ``window``: a
    sliding window (decodes read only their last ``window`` keys, chunks are masked)."""
    cu = cu_seqlens_q.tolist()
    if window is not None and len(cu) > 1:
        runs = _window_decodes(runs, cu, window)
    num_slots = k_cache.shape[0]
    row_bytes = slot_bytes(k_cache) + slot_bytes(v_cache)
    planner = _Planner(num_slots, row_bytes, num_heads * k_cache.shape[-1] * FP32,
                       k_cache.device, positions)
    short = planner.short_decodes(runs, cu) if k_cache.device.type == "cpu" else []
    batched = set(short)
    decodes, shared = planner.decodes(runs, cu, batched)
    # Decodes whose last key's piece is known: the length of that run where it is gathered.
    tails: dict[int, int] = {}
    seqs: list[SeqPlan] = []
    members: list[int] = []
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        p0, p1 = runs.ptr[b], runs.ptr[b + 1]
        if q1 == q0:
            continue
        pieces: tuple[tuple[Piece, bool], ...] = ()
        if b in batched:
            members.append(len(seqs))
        elif b in decodes:
            pieces, tail, gathered = decodes[b]
            if tail >= 0:
                tails[b] = gathered
            seqs.append(SeqPlan(q0, q1, pieces, tail=tail))
            continue
        elif p1 > p0 and runs.context[b] > 0 and window is not None and q1 - q0 > 1:
            pieces = planner.windowed(q1 - q0, runs.segs[:, p0:p1], runs.context[b], window)
            seqs.append(SeqPlan(q0, q1, pieces, windowed=True))
            continue
        elif p1 > p0 and runs.context[b] > 0:
            pieces = planner.sequence(q1 - q0, runs.segs[:, p0:p1], runs.context[b])
        seqs.append(SeqPlan(q0, q1, pieces))
    batch = planner.short_batch(short, tuple(members), cu, runs) if short else None
    source = None
    if not positions and window is None and len(cu) > 1 and cu[-1] == len(cu) - 1:
        steps = planner.steps(runs, batch, shared, tails)
        source = Source(runs.layout, np.asarray(runs.context, dtype=np.int64), steps)
    return AttentionPlan(cu[-1] if cu else 0, num_slots, row_bytes, positions, window,
                         tuple(seqs), batch, shared, source)


def advance(plan: AttentionPlan, layout: np.ndarray, context: np.ndarray,
            cu_seqlens_q: Tensor) -> AttentionPlan | None:
    """``plan`` carried on to the next decode step, without planning afresh, where that step
    decodes the same sequences in the same layout one key further each and ``plan`` can be
    carried that far (see :attr:`Source.steps`); else None. ``layout``: the step's layout
    array (block tables, extent starts)."""
    src = plan.source
    if src is None or src.steps < 1 or not np.array_equal(context, src.context + 1):
        return None
    seen = layout[:, : src.layout.shape[1]] if layout.ndim == 2 else layout
    if seen.shape != src.layout.shape or not np.array_equal(seen, src.layout):
        return None
    if cu_seqlens_q.tolist() != list(range(len(context) + 1)):
        return None
    seqs = tuple(_lengthened(sp) for sp in plan.seqs)
    short = plan.short
    if short is not None:
        visible, mask = _visible(short.visible.shape[1], context[short.rows.numpy()])
        short = replace(short, visible=visible, mask=mask)
    return replace(plan, seqs=seqs, short=short,
                   source=Source(src.layout, context, src.steps - 1))


def _visible(width: int, context: np.ndarray) -> tuple[Tensor, Tensor]:
    """Of a batch of short decodes' ``width`` copied slots, which are each one's keys (its
    first ``context``), and the fused kernel's additive mask of that ``[n, 1, 1, width]``."""
    visible = np.arange(width)[None, :] < context[:, None]
    mask = np.where(visible, np.float32(0), np.float32("-inf"))[:, None, None]
    return torch.from_numpy(visible), torch.from_numpy(mask)


def _lengthened(sp: SeqPlan) -> SeqPlan:
    """``sp`` with the piece holding its last key one key longer."""
    if sp.tail < 0:
        return sp
    piece, causal = sp.pieces[sp.tail]
    longer: Piece = (Shared(piece.start, piece.length + 1) if isinstance(piece, Shared)
                     else (piece[0], piece[1] + 1))  # type: ignore[index]
    pieces = (*sp.pieces[: sp.tail], (longer, causal), *sp.pieces[sp.tail + 1 :])
    return replace(sp, pieces=pieces)


def slot_bytes(cache: Tensor) -> int:
    """The bytes of one slot of ``cache`` ``[S, ...]`` (``cache[0].nbytes``, with no op)."""
    return math.prod(cache.shape[1:]) * cache.element_size()


def _window_decodes(runs: Runs, cu: list[int], window: int) -> Runs:
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
    return Runs(ptr, np.concatenate(parts, axis=1), context, runs.layout, runs.block)


@dataclass(frozen=True, slots=True)
class _Planner:
    num_slots: int
    row_bytes: int
    out_row_bytes: int
    device: torch.device
    positions: bool

    def short_decodes(self, runs: Runs, cu: list[int]) -> list[int]:
        """The decodes to attend in one padded batch (see SHORT_DECODE_BYTES)."""
        ctx = np.asarray(runs.context, dtype=np.int64)
        short = (np.diff(cu) == 1) & (np.diff(runs.ptr) > 0) & (ctx > 0)
        short &= ctx * self.row_bytes <= SHORT_DECODE_BYTES
        return np.flatnonzero(short).tolist() if short.sum() > 1 else []

    def short_batch(self, group: list[int], in_plan: tuple[int, ...], cu: list[int],
              runs: Runs) -> ShortDecodes:
        """The padded batch of short decodes ``group`` (``in_plan``: their indices in the plan)."""
        first = np.array([runs.ptr[b] for b in group])
        counts = np.array([runs.ptr[b + 1] for b in group]) - first
        ends = np.cumsum(counts)
        picked = np.arange(ends[-1]) + np.repeat(first - (ends - counts), counts)
        slot, key, length = runs.segs[:, picked]
        ctx = np.array([runs.context[b] for b in group])
        # The largest unit at which every run starts, places its keys and, but for each
        # sequence's last run, ends: whole blocks of a paged cache.
        inner = np.delete(length, ends - 1)
        unit = int(np.gcd.reduce(np.concatenate([slot, key, inner, [self.num_slots]])))
        num_units = -(-length // unit)
        width = int(-(-ctx.max() // unit))
        units = np.repeat(slot[ends - counts] // unit, width).reshape(len(group), width)
        unit_ends = np.cumsum(num_units)
        offset = np.arange(unit_ends[-1]) - np.repeat(unit_ends - num_units, num_units)
        owner = np.repeat(np.arange(len(group)), counts)
        units[np.repeat(owner, num_units), np.repeat(key // unit, num_units) + offset] = (
            np.repeat(slot // unit, num_units) + offset
        )
        visible, mask = _visible(width * unit, ctx)
        return ShortDecodes(in_plan, torch.tensor([cu[b] for b in group]), unit,
                            torch.from_numpy(units), visible, mask,
                            torch.from_numpy(self._pair(units.ravel(), unit)))

    def decodes(self, runs: Runs, cu: list[int], batched: set[int]
                ) -> tuple[dict[int, tuple[tuple[tuple[Piece, bool], ...], int, int]],
                           Gather | None]:
        """The pieces of every decode not in ``batched``, by sequence, as :meth:`sequence`
        makes them for one query, planned for all of them at once, with the index of the
        piece holding its last key and, where that key's run is gathered, the run's length
        (else 0); their gathered runs go to one shared gather (returned; None without
        any)."""
        ctx, ptr = np.asarray(runs.context, dtype=np.int64), np.asarray(runs.ptr)
        pick = (np.diff(cu) == 1) & (ctx > 0) & (np.diff(ptr) > 0)
        pick[list(batched)] = False
        group = np.flatnonzero(pick)
        if not len(group):
            return {}, None
        counts = ptr[group + 1] - ptr[group]
        ends = np.cumsum(counts)
        picked = np.arange(ends[-1]) + np.repeat(ptr[group] - (ends - counts), counts)
        owner = np.repeat(np.arange(len(group)), counts)
        slot, key, length = runs.segs[:, picked]
        # Where the run holding each one's last key ends.
        last = key + length == ctx[group][owner]
        tail_end = np.zeros(len(group), dtype=np.int64)
        tail_end[owner[last]] = (slot + length)[last]
        # Each decode's runs sorted by slot and joined where one ends at the next's start
        # (as _coalesce: a decode sees its keys in any order).
        order = np.lexsort((slot, owner))
        slot, length, owner = slot[order], length[order], owner[order]
        starts = np.ones(len(slot), dtype=bool)
        starts[1:] = (owner[1:] != owner[:-1]) | (slot[1:] != slot[:-1] + length[:-1])
        first = np.flatnonzero(starts)
        slot, owner, length = slot[first], owner[first], np.add.reduceat(length, first)
        # In place: long runs, a decode's only run, and the one run left of a decode's runs
        # (as _pieces); the others gathered.
        view = length * self.row_bytes >= MIN_VIEW_BYTES + MERGE_COST * self.out_row_bytes
        view |= np.bincount(owner, minlength=len(group))[owner] == 1
        view |= np.bincount(owner[~view], minlength=len(group))[owner] == 1
        is_tail = slot + length == tail_end[owner]
        gathered_tail = np.zeros(len(group), dtype=np.int64)
        gathered_tail[owner[is_tail & ~view]] = length[is_tail & ~view]
        pieces: list[list[tuple[Piece, bool]]] = [[] for _ in group]
        tails = [-1] * len(group)
        for o, a, n, t in zip(owner[view].tolist(), slot[view].tolist(),
                              length[view].tolist(), is_tail[view].tolist(), strict=True):
            if t:
                tails[o] = len(pieces[o])
            pieces[o].append(((a, n), False))
        shared = None
        if not view.all():
            shared, spans = self._shared(slot[~view], length[~view], owner[~view])
            for o, start, n in spans:
                if gathered_tail[o]:
                    tails[o] = len(pieces[o])
                pieces[o].append((Shared(start, n), False))
        return {int(b): (tuple(p), t, int(g)) for b, p, t, g in zip(
            group.tolist(), pieces, tails, gathered_tail.tolist(), strict=True)}, shared

    def steps(self, runs: Runs, short: ShortDecodes | None, shared: Gather | None,
              tails: dict[int, int]) -> int:
        """For how many steps of one key more per sequence a plan of these decodes stays
        the plan made afresh (see :func:`advance`): no key may open or fill a unit copied
        whole (a block, a gather's unit), no short decode may outgrow the batch, no gathered
        run may grow long enough to be read in place; a decode whose last key is in no
        known piece (none, or no key) stops it."""
        ctx = np.asarray(runs.context, dtype=np.int64)
        if len(tails) + (len(short.seqs) if short else 0) < len(ctx) or not ctx.all():
            return 0
        units = [u for u in (runs.block, shared and shared.unit, short and short.unit) if u]
        left = np.full(len(ctx), 2**31, dtype=np.int64)
        if units:
            unit = int(np.gcd.reduce(units))
            within = ctx % unit
            if not within.all():
                return 0
            left = unit - 1 - within
        if short is not None:
            rows = short.rows.numpy()
            left[rows] = np.minimum(left[rows], SHORT_DECODE_BYTES // self.row_bytes - ctx[rows])
        view_keys = -(-(MIN_VIEW_BYTES + MERGE_COST * self.out_row_bytes) // self.row_bytes)
        for b, n in tails.items():
            if n:
                left[b] = min(left[b], view_keys - 1 - n)
        return max(int(left.min()), 0)

    def _shared(self, slots: np.ndarray, lengths: np.ndarray, owner: np.ndarray
                ) -> tuple[Gather, list[tuple[int, int, int]]]:
        """The shared gather of runs (first slots, lengths) of decodes ``owner`` (sorted by
        owner), and each decode's span of it (owner, first key, length): runs copied in
        whole units common to all (as :meth:`_gather`), each decode's partial run last."""
        unit = int(np.gcd.reduce(np.append(slots, self.num_slots)))
        order = np.lexsort((lengths % unit != 0, owner))
        slots, lengths, owner = slots[order], lengths[order], owner[order]
        last = np.append(owner[1:] != owner[:-1], True)
        unit = int(np.gcd.reduce(np.append(lengths[~last], unit)))
        counts = -(-lengths // unit)
        ends = np.cumsum(counts)
        ids = np.arange(ends[-1]) + np.repeat(slots // unit - (ends - counts), counts)
        firsts = np.flatnonzero(np.append(True, owner[1:] != owner[:-1]))
        spans = zip(owner[firsts].tolist(), ((ends - counts)[firsts] * unit).tolist(),
                    np.add.reduceat(lengths, firsts).tolist(), strict=True)
        tokens = (ids[:, None] * unit + np.arange(unit)).ravel()
        gather = Gather(len(tokens), unit, torch.from_numpy(ids).to(self.device),
                        torch.from_numpy(tokens).to(self.device),
                        torch.from_numpy(self._pair(ids, unit)).to(self.device))
        return gather, list(spans)

    def sequence(self, nq: int, segs: np.ndarray, ctx: int) -> tuple[tuple[Piece, bool], ...]:
        if self.positions or nq == 1:
            parts = [(_coalesce(segs), False)]
        else:
            # Keys before the chunk are seen by every query; the chunk's own keys form a
            # causal square.
            split = ctx - nq
            parts = [(_coalesce(_clip(segs, 0, split)), False), (_clip(segs, split, ctx), True)]
        return tuple(
            (piece, causal) for part, causal in parts for piece in self._pieces(part, nq, causal)
        )

    def windowed(self, nq: int, segs: np.ndarray, ctx: int, window: int
                 ) -> tuple[tuple[Piece, bool], ...]:
        """A windowed prefill chunk's one piece: keys from the first query's window on."""
        segs = _clip(segs, max(ctx - nq - window + 1, 0), ctx)
        piece: Piece = (int(segs[0, 0]), int(segs[2, 0])) if segs.shape[1] == 1 else (
            self._gather(segs[0], segs[2], in_order=True))
        return ((piece, False),)

    def _pieces(self, segs: np.ndarray, nq: int, causal: bool) -> list[Piece]:
        """Runs long enough to attend on their own as slices, the others gathered together;
        a ``causal`` part (a chunk's own keys) is one piece with its keys in order."""
        if segs.shape[1] == 1:
            return [(int(segs[0, 0]), int(segs[2, 0]))]
        long = segs[2] * self.row_bytes >= MIN_VIEW_BYTES + MERGE_COST * nq * self.out_row_bytes
        if causal:
            long[:] = False
        pieces: list[Piece] = [(int(a), int(n)) for a, n in segs[[0, 2]][:, long].T]
        short = segs[:, ~long]
        if short.shape[1] == 1:
            pieces.append((int(short[0, 0]), int(short[2, 0])))
        elif short.shape[1]:
            pieces.append(self._gather(short[0], short[2], in_order=causal))
        return pieces

    def _gather(self, slots: np.ndarray, lengths: np.ndarray, in_order: bool) -> Gather:
        # Copy in the largest units that the runs allow (whole blocks, as a rule): indexing
        # long rows is several times faster than indexing single tokens. Only the last run
        # may end inside a unit, so where order is free a partial block (a sequence's last,
        # anywhere once runs are sorted by slot) goes last.
        unit = int(np.gcd.reduce(np.append(slots, self.num_slots)))
        if not in_order:
            last = np.argsort(lengths % unit != 0, kind="stable")
            slots, lengths = slots[last], lengths[last]
        unit = int(np.gcd.reduce(np.append(lengths[:-1], unit)))
        counts = -(-lengths // unit)
        ends = np.cumsum(counts)
        ids = np.arange(ends[-1]) + np.repeat(slots // unit - (ends - counts), counts)
        key_ends = np.cumsum(lengths)
        tokens = np.arange(key_ends[-1]) + np.repeat(slots - (key_ends - lengths), lengths)
        return Gather(int(key_ends[-1]), unit, torch.from_numpy(ids).to(self.device),
                      torch.from_numpy(tokens).to(self.device),
                      torch.from_numpy(self._pair(ids, unit)).to(self.device))

    def _pair(self, ids: np.ndarray, unit: int) -> np.ndarray:
        """Unit ids ``ids`` of K, then the same units of V stored right after K."""
        return np.concatenate([ids, ids + self.num_slots // unit])
