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

from dataclasses import dataclass

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
    keys ``key .. key + length - 1`` in order."""

    ptr: list[int]
    segs: np.ndarray
    context: list[int]


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
    return Runs(ptr.tolist(), np.stack([block[first] * block_size, key, length]), ctx.tolist())


def extent_runs(extent_starts: Tensor, context_lens: Tensor) -> Runs:
    ctx = context_lens.cpu().numpy().astype(np.int64)
    starts = extent_starts.cpu().numpy().astype(np.int64)
    return Runs(list(range(len(ctx) + 1)), np.stack([starts, np.zeros_like(ctx), ctx]),
                ctx.tolist())


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


# A piece of one sequence's keys: a slice (first slot, length) read in place, or a gather.
Piece = tuple[int, int] | Gather


@dataclass(frozen=True, slots=True)
class SeqPlan:
    """Query rows ``q0 : q1`` of one sequence and the pieces of its keys, each with whether
    the causal mask applies (a prefill chunk's own keys); no pieces: it sees no key (or it is
    in the plan's batch of short decodes). ``windowed``: a prefill chunk under a sliding
    window, one piece of the keys any of its queries sees, in order, each query masked to its
    own window."""

    q0: int
    q1: int
    pieces: tuple[tuple[Piece, bool], ...]
    windowed: bool = False


@dataclass(frozen=True, slots=True)
class ShortDecodes:
    """Short decodes attended in one call: ``seqs`` index :attr:`AttentionPlan.seqs`, ``rows`` are
    their query rows ``[n]``; ``units`` ``[n, m]`` the units of ``unit`` slots holding each
    one's keys in key order, padded with its first (a finite value, since masked
    probabilities still multiply what they mask); ``visible`` ``[n, m * unit]`` which copied
    slots are its keys."""

    seqs: tuple[int, ...]
    rows: Tensor
    unit: int
    units: Tensor
    visible: Tensor
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
    row_bytes = k_cache[0].nbytes + v_cache[0].nbytes
    planner = _Planner(num_slots, row_bytes, num_heads * k_cache.shape[-1] * FP32,
                       k_cache.device, positions)
    short = planner.short_decodes(runs, cu) if k_cache.device.type == "cpu" else []
    batched = set(short)
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
        elif p1 > p0 and runs.context[b] > 0 and window is not None and q1 - q0 > 1:
            pieces = planner.windowed(q1 - q0, runs.segs[:, p0:p1], runs.context[b], window)
            seqs.append(SeqPlan(q0, q1, pieces, windowed=True))
            continue
        elif p1 > p0 and runs.context[b] > 0:
            pieces = planner.sequence(q1 - q0, runs.segs[:, p0:p1], runs.context[b])
        seqs.append(SeqPlan(q0, q1, pieces))
    batch = planner.short_batch(short, tuple(members), cu, runs) if short else None
    return AttentionPlan(cu[-1] if cu else 0, num_slots, row_bytes, positions, window,
                         tuple(seqs), batch)


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
    return Runs(ptr, np.concatenate(parts, axis=1), context)


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
        visible = np.arange(width * unit)[None, :] < ctx[:, None]
        return ShortDecodes(in_plan, torch.tensor([cu[b] for b in group]), unit,
                            torch.from_numpy(units), torch.from_numpy(visible),
                            torch.from_numpy(self._pair(units.ravel(), unit)))

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
