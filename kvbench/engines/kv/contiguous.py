"""Contiguous KV manager: one extent per sequence in a linear arena of token slots.

This is the pre-paging design (HF static caches, FasterTransformer, Orca): at admission a
sequence reserves an extent large enough for everything it may ever hold, so it never needs
to grow but leaves the unused tail idle, and freed extents leave holes that only a request
small enough can reuse. Position ``p`` of a sequence lives in slot ``extent start + p``.

Reservation policies: ``max_model_len`` (the whole context window), ``request`` (prompt +
output, the tightest possible: it needs the output length in advance), ``pow2`` (the next power
of two, as size-class allocators do). With ``compaction`` a request that fits in the total free
space but in no single hole slides every extent to the left, at a measured copy cost; with
``auto_defrag = T`` the same compaction also runs whenever freeing an extent leaves the
fragmentation index (largest hole / free) below ``T`` (the reports' auto_defrag, P6), after
a free or an admission.

``align_bytes`` rounds every allocation up to a multiple of that many bytes, as a CUDA
allocator's alignment does (the reports' C4 says 128 B): each layer's K and V of an extent is
one allocation, so an extent's length becomes a multiple of the tokens whose K (or V) of one
layer on one rank fill whole aligned units, and the rounding is measured as internal waste.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from kvbench.engines.base import KVStats
from kvbench.engines.config import EngineConfig, KVPolicy
from kvbench.engines.kv.arena import FITS, Arena, Fit
from kvbench.engines.kv.base import KVManager, steps_to_end, written_columns
from kvbench.engines.kv.spec import Footprint, KVSpec
from kvbench.engines.sequence import Sequence
from kvbench.errors import KvbenchError
from kvbench.kernels.layouts import Extents
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.workloads.model import Request

Reservation = Literal["max_model_len", "request", "pow2"]
RESERVATIONS: tuple[str, ...] = ("max_model_len", "request", "pow2")


class ContiguousPolicy(KVPolicy):
    """One extent per sequence in a linear arena, reserved at admission."""

    kind: Literal["contiguous"] = "contiguous"
    summary = "one reserved extent per sequence (max_model_len | request | pow2), first/best fit"
    reservation: Reservation = "max_model_len"
    fit: Fit = "first"
    compaction: bool = False
    auto_defrag: float | None = Field(default=None, gt=0.0, le=1.0)
    align_bytes: int = Field(default=1, ge=1)

    def label(self) -> str:
        return f"contiguous/{self.reservation}" + ("+compact" if self.compaction else "") + (
            f"+defrag{self.auto_defrag:g}" if self.auto_defrag else "") + (
            f"+align{self.align_bytes}" if self.align_bytes > 1 else "")

    def footprint(self, config: EngineConfig, request: Request) -> Footprint:
        return extent_footprint(request, self.reservation, config.scheduler.max_model_len,
                                config.capacity_tokens, self.align_slots(config))

    def align_slots(self, config: EngineConfig) -> int:
        """Tokens an extent's length is a multiple of under ``align_bytes``: one layer's K
        (or V) on one rank per token is the unit the allocator aligns."""
        preset, tp = config.preset, config.device.tp
        tensor_bytes = preset.kv_bytes_per_token_per_rank(tp) // (2 * preset.num_layers)
        return self.align_bytes // math.gcd(self.align_bytes, tensor_bytes)

    def manager(self, config: EngineConfig) -> ContiguousKVManager:
        return ContiguousKVManager(
            config.capacity_tokens, config.kv.bytes_per_token, config.scheduler.max_model_len,
            reservation=self.reservation, fit=self.fit, compaction=self.compaction,
            dtype=config.kv.dtype, auto_defrag=self.auto_defrag,
            align_slots=self.align_slots(config),
        )


def reserve_len(reservation: Reservation, num_tokens: int, max_model_len: int,
                align_slots: int = 1) -> int:
    """Extent length ``reservation`` reserves for a sample that will hold ``num_tokens``,
    rounded up to a multiple of ``align_slots``."""
    if reservation == "max_model_len":
        length = max_model_len
    elif reservation == "request":
        length = num_tokens
    else:
        length = min(1 << (num_tokens - 1).bit_length(), max_model_len)
    return -(-length // align_slots) * align_slots


def extent_footprint(request: Request, reservation: Reservation, max_model_len: int,
                     capacity_tokens: int, align_slots: int = 1) -> Footprint:
    """All of ``request``'s extents (they are reserved together, so must fit together)."""
    length = reserve_len(reservation, request.prompt_tokens + request.output_tokens,
                         max_model_len, align_slots)
    samples = f"{request.n} samples x " if request.n > 1 else ""
    return Footprint(
        tokens=request.n * length, capacity_tokens=capacity_tokens,
        what=f"extents of {samples}{length} tokens (reservation={reservation})",
        capacity=f"{capacity_tokens} tokens",
        hint=" or use a tighter reservation policy" if reservation != "request" else "",
    )


@dataclass(slots=True)
class _Extent:
    start: int
    length: int
    final_len: int  # tokens whose KV its sequence writes by the end (not the last sampled)
    num_committed: int = 0  # leading slots whose KV is written (as of the last commit)


class ContiguousKVManager(KVManager):
    """Contiguous KV bookkeeping over an arena of ``capacity_tokens`` slots.

    A request with ``n > 1`` samples reserves all ``n`` extents when its first sample is
    admitted before its prefill (all or nothing, so forking can never fail); ``fork`` then
    hands each child one of them plus a copy of the parent's KV.
    """

    kind = "contiguous"

    def __init__(
        self,
        capacity_tokens: int,
        bytes_per_token: int,
        max_model_len: int,
        reservation: Reservation = "max_model_len",
        fit: Fit = "first",
        compaction: bool = False,
        dtype: str | None = None,
        auto_defrag: float | None = None,
        align_slots: int = 1,
    ) -> None:
        for name, value in (
            ("capacity_tokens", capacity_tokens),
            ("bytes_per_token", bytes_per_token),
            ("max_model_len", max_model_len),
            ("align_slots", align_slots),
        ):
            if value <= 0:
                raise KvbenchError(f"contiguous KV cache: {name} must be positive, got {value}")
        if reservation not in RESERVATIONS:
            raise KvbenchError(
                f"unknown reservation {reservation!r}: use one of {', '.join(RESERVATIONS)}"
            )
        if fit not in FITS:
            raise KvbenchError(f"unknown fit {fit!r}: use one of {', '.join(FITS)}")
        self.capacity_tokens = capacity_tokens
        # Extents have any length: the page is one token slot.
        self.spec = KVSpec(1, bytes_per_token, dtype)
        self.max_model_len = max_model_len
        self.reservation = reservation
        self.fit = fit
        self.compaction = compaction
        self.auto_defrag = auto_defrag
        self.align_slots = align_slots
        self.arena = Arena(capacity_tokens, fit)
        self._extents: dict[int, _Extent] = {}
        self._spare: dict[int, list[_Extent]] = {}  # parent seq_id -> extents for its forks
        self._copies: list[SlotCopy] = []
        self._reserved_tokens = 0
        # Slots all extents (spares included) will hold written KV in by their ends; minus
        # _used_tokens, the slots still to be written (stats() reads it every step).
        self._limit_tokens = 0
        self._used_tokens = 0
        self._allocs = 0
        self._frees = 0
        self._copied_bytes = 0

    def reserve_len(self, num_tokens: int) -> int:
        """Extent length reserved for a sample that will hold ``num_tokens`` tokens."""
        return reserve_len(self.reservation, num_tokens, self.max_model_len, self.align_slots)

    def footprint(self, request: Request) -> Footprint:
        return extent_footprint(request, self.reservation, self.max_model_len,
                                self.capacity_tokens, self.align_slots)

    def held_tokens(self, prompt: int, output: int, n: int = 1) -> int:
        return n * self.reserve_len(prompt + output)

    def lookup_prefix(self, seq: Sequence) -> int:
        return 0  # no prefix caching: extents are private

    def allocate(self, seq: Sequence, num_cached: int, num_new: int) -> bool:
        if seq.seq_id in self._extents:
            raise RuntimeError(f"sequence {seq.seq_id} is already allocated")
        if num_cached:
            raise RuntimeError("the contiguous KV manager has no prefix cache")
        length = self.reserve_len(seq.max_tokens)
        if num_new > length:
            raise RuntimeError(f"sequence {seq.seq_id}: {num_new} tokens exceed its extent")
        # Sample 0 before its prefill will fork the other samples right after it.
        forks_ahead = seq.sample_index == 0 and not seq.output_ids
        count = seq.request.n if forks_ahead else 1
        starts = self._place(length, count)
        if starts is None:
            return False
        extents = [_Extent(start, length, seq.max_tokens - 1) for start in starts]
        self._extents[seq.seq_id] = extents[0]
        if count > 1:
            self._spare[seq.seq_id] = extents[1:]
        self._allocs += count
        self._reserved_tokens += count * length
        self._limit_tokens += count * min(length, seq.max_tokens - 1)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        self._defrag_if_fragmented()
        return True

    def grow(self, seq: Sequence, num_new: int) -> bool:
        ext = self._extents[seq.seq_id]
        if seq.num_computed_tokens + num_new > ext.length:
            raise RuntimeError(
                f"sequence {seq.seq_id} outgrew its extent of {ext.length} tokens: the "
                "reservation should cover prompt + output"
            )
        return True

    def commit(self, seq: Sequence) -> None:
        ext = self._extents[seq.seq_id]
        n = seq.num_computed_tokens
        if not ext.num_committed <= n <= ext.length:
            raise RuntimeError(
                f"sequence {seq.seq_id}: {n} computed tokens outside its extent "
                f"(committed {ext.num_committed}, length {ext.length})"
            )
        self._used_tokens += n - ext.num_committed
        ext.num_committed = n

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s extent (and unforked spares). A sequence holding none is a no-op."""
        ext = self._extents.pop(seq.seq_id, None)
        if ext is None:
            return
        for e in [ext, *self._spare.pop(seq.seq_id, [])]:
            self.arena.give(e.start, e.length)
            self._reserved_tokens -= e.length
            self._limit_tokens -= min(e.length, e.final_len)
            self._used_tokens -= e.num_committed
            self._frees += 1
        self._defrag_if_fragmented()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self._extents:
            raise RuntimeError(f"sequence {child.seq_id} is already allocated")
        spare = self._spare.get(parent.seq_id)
        if not spare:
            raise RuntimeError(f"sequence {parent.seq_id} has no extent reserved for a fork")
        ext = spare.pop()
        if not spare:
            del self._spare[parent.seq_id]
        src = self._extents[parent.seq_id]
        n = src.num_committed
        if n:
            self._queue_copy(src.start, ext.start, n)
        ext.num_committed = n
        self._used_tokens += n
        self._extents[child.seq_id] = ext

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        ext = self._extents[seq.seq_id]
        if not 0 <= start <= end <= ext.length:
            raise RuntimeError(
                f"sequence {seq.seq_id}: positions [{start}, {end}) outside its extent "
                f"of {ext.length}"
            )
        return np.arange(ext.start + start, ext.start + end, dtype=np.int64)

    def extent(self, seq: Sequence) -> tuple[int, int]:
        """(start slot, reserved length) of ``seq``'s extent."""
        ext = self._extents[seq.seq_id]
        return ext.start, ext.length

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> Extents:
        extents = self._extents
        return Extents(np.array([extents[s.seq_id].start for s in seqs], dtype=np.int64))

    def take_copies(self) -> list[SlotCopy]:
        copies, self._copies = self._copies, []
        return copies

    def stats(self) -> KVStats:
        """``used_bytes`` counts written token slots (committed KV, fork copies included);
        ``reserved_bytes`` whole extents, spares for unforked samples included;
        ``reserved_ahead_bytes`` the slots of those extents still to be written."""
        bpt = self.bytes_per_token
        ahead = self._limit_tokens - self._used_tokens
        return KVStats(
            capacity_bytes=self.capacity_tokens * bpt,
            used_bytes=self._used_tokens * bpt,
            reserved_bytes=self._reserved_tokens * bpt,
            reserved_ahead_bytes=ahead * bpt,
            free_bytes=(self.capacity_tokens - self._reserved_tokens) * bpt,
            largest_free_bytes=self.arena.largest * bpt,
            shared_bytes=0,
            block_allocs=self._allocs,
            block_frees=self._frees,
            copied_bytes=self._copied_bytes,
            # One (start, length) descriptor per extent, spares for forks included.
            page_table_entries=self._allocs - self._frees,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "capacity_tokens": self.capacity_tokens,
            "bytes_per_token": self.bytes_per_token,
            "max_model_len": self.max_model_len,
            "reservation": self.reservation,
            "fit": self.fit,
            "compaction": self.compaction,
            "auto_defrag": self.auto_defrag,
            "align_slots": self.align_slots,
        }

    # --- decode fast-forward ---------------------------------------------------------------

    def decode_room(self, seqs: list[Sequence], max_steps: int, keep_cached: bool = False) -> int:
        """Extents are reserved at admission, so decodes only write into them: any number of
        steps up to the end of the shortest room left."""
        if self._copies:
            return 0

        def held(seq: Sequence) -> tuple[int, int]:
            ext = self._extents[seq.seq_id]
            return ext.num_committed, ext.length

        return steps_to_end(seqs, max_steps, held)

    def advance_decode(self, seqs: list[Sequence], steps: int) -> dict[str, np.ndarray]:
        n, used = len(seqs), self._used_tokens
        columns = written_columns(n, steps, self.bytes_per_token, used, used, self._limit_tokens)
        extents = self._extents
        for seq in seqs:
            extents[seq.seq_id].num_committed += steps
        self._used_tokens += n * steps
        return columns

    def would_admit(self, seq: Sequence, num_cached: int, num_new: int) -> bool | None:
        if seq.seq_id in self._extents or num_cached:
            return None
        length = self.reserve_len(seq.max_tokens)
        if num_new > length:
            return None
        count = seq.request.n if seq.sample_index == 0 and not seq.output_ids else 1
        trial = self.arena.copy()
        if all(trial.take(length) is not None for _ in range(count)):
            return True
        return self.compaction and self.arena.total_free >= count * length

    def _place(self, length: int, count: int) -> list[int] | None:
        """Starts of ``count`` new extents of ``length``, all or none (compacting if allowed)."""
        trial = self.arena.copy()
        starts = []
        for _ in range(count):
            start = trial.take(length)
            if start is None:
                break
            starts.append(start)
        else:
            self.arena = trial
            return starts
        if not self.compaction or self.arena.total_free < count * length:
            return None
        self._compact()
        return [self._take(length) for _ in range(count)]

    def _defrag_if_fragmented(self) -> None:
        """With ``auto_defrag``, compact once the fragmentation index (largest hole / free
        slots) is below it: a free can split the free space, an extent carved from the
        largest hole can shrink it."""
        if self.auto_defrag is None:
            return
        free = self.capacity_tokens - self._reserved_tokens
        if free > 0 and self.arena.largest < self.auto_defrag * free:
            self._compact()

    def _take(self, length: int) -> int:
        start = self.arena.take(length)
        if start is None:
            raise AssertionError("compaction left no hole large enough")
        return start

    def _compact(self) -> None:
        """Slide every extent left, in address order, into one block at the arena's start.

        Each move's destination lies below its source and above every extent already moved,
        so executing the queued copies one after another (each as if through a temporary)
        never overwrites data still to be moved. Only written slots are copied.
        """
        cursor = 0
        for ext in sorted(self._all_extents(), key=lambda e: e.start):
            if ext.start != cursor:
                if ext.num_committed:
                    self._queue_copy(ext.start, cursor, ext.num_committed)
                ext.start = cursor
            cursor += ext.length
        self.arena.reset(cursor)

    def _all_extents(self) -> list[_Extent]:
        """Live sequences' extents and the spares reserved for their forks."""
        return [*self._extents.values(), *(e for s in self._spare.values() for e in s)]

    def _queue_copy(self, src: int, dst: int, num_slots: int) -> None:
        self._copies.append(SlotCopy(src=src, dst=dst, num_slots=num_slots))
        self._copied_bytes += num_slots * self.bytes_per_token
