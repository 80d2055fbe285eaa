"""Contiguous KV bookkeeping of the event replay: the contiguous manager's
(:mod:`kvbench.engines.kv.contiguous`) extents in a linear arena, with decoding sequences
held lazily. Decoders only write into extents reserved at admission, so a step of them is
one addition; compaction, which copies what each extent holds, reads every sequence's
computed tokens at that moment (``step``: decoders have computed ``step + c``).

One sample per request: no spare extents for forks."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.engines.base import KVStats
from kvbench.engines.kv.arena import Arena
from kvbench.engines.kv.contiguous import ContiguousKVManager, reserve_len
from kvbench.engines.sim.replay.seq import Seq
from kvbench.kernels.slot_copy import SlotCopy


class ContiguousBook:
    tier_kinds: tuple[str, ...] = ()

    def __init__(self, manager: ContiguousKVManager) -> None:
        m = manager
        self.bpt = m.bytes_per_token
        self.capacity_tokens = m.capacity_tokens
        self.capacity = m.capacity_tokens * self.bpt
        self.page_bytes = self.bpt
        self.page_tokens = 1
        self.footprint = m.footprint
        self._reserve = (m.reservation, m.max_model_len, m.align_slots)
        self.compaction = m.compaction
        self.auto_defrag = m.auto_defrag
        self.arena = Arena(m.capacity_tokens, m.fit)
        self.reserved = self.limit = self.used = 0
        self.allocs = self.frees = self.copied = 0
        self.copies: list[SlotCopy] = []
        self.live: dict[Seq, None] = {}

    def reserve_len(self, seq: Seq) -> int:
        reservation, max_model_len, align = self._reserve
        return reserve_len(reservation, seq.final_len + 1, max_model_len, align)

    # Decoders write into their extents: nothing to allocate or index.
    def join(self, seq: Seq) -> None:
        """Nothing: a decoder needs nothing of the arena."""

    def leave(self, seq: Seq) -> None:
        """Nothing: see :meth:`join`."""

    def grows_at(self, step: int) -> list[Seq]:
        return []

    def grow_decoders(self, seqs: list[Seq]) -> None:
        """Never called: see :meth:`grows_at`."""

    def fill_decoders(self, step: int) -> None:
        """Nothing: no prefix cache."""

    def advance(self, tokens: int) -> None:
        self.used += tokens

    def fresh(self, seq: Seq, pos: int, num_new: int) -> int:
        return 0

    def fits(self, blocks: int) -> bool:
        return True

    def grow(self, seq: Seq, pos: int, num_new: int) -> bool:
        if pos + num_new > seq.length:
            raise RuntimeError(
                f"sequence of {seq.rid} outgrew its extent of {seq.length} tokens: the "
                "reservation should cover prompt + output"
            )
        return True

    def lookup(self, seq: Seq) -> tuple[int, list[int]]:
        return 0, []

    def would_admit(self, seq: Seq, cached: int, hits: list[int], num_new: int) -> bool | None:
        length = self.reserve_len(seq)
        if num_new > length:
            return None
        return self.arena.largest >= length or (
            self.compaction and self.arena.total_free >= length)

    def allocate(self, seq: Seq, cached: int, hits: list[int], num_new: int, step: int) -> bool:
        length = self.reserve_len(seq)
        if num_new > length:
            raise RuntimeError(f"sequence of {seq.rid}: {num_new} tokens exceed its extent")
        start = self.arena.take(length)
        if start is None:
            if not self.compaction or self.arena.total_free < length:
                return False
            self._compact(step)
            start = self.arena.take(length)
            if start is None:
                raise AssertionError("compaction left no hole large enough")
        seq.start, seq.length = start, length
        self.live[seq] = None
        self.allocs += 1
        self.reserved += length
        self.limit += min(length, seq.final_len)
        self._defrag_if_fragmented(step)
        return True

    def commit(self, seq: Seq, before: int, after: int) -> None:
        self.used += after - before

    def free(self, seq: Seq, finished: bool, committed: int, step: int) -> None:
        del self.live[seq]
        self.arena.give(seq.start, seq.length)
        self.reserved -= seq.length
        self.limit -= min(seq.length, seq.final_len)
        self.used -= committed
        self.frees += 1
        self._defrag_if_fragmented(step)

    def take_copies(self) -> list[SlotCopy]:
        copies, self.copies = self.copies, []
        return copies

    def copies_pending(self) -> bool:
        return bool(self.copies)

    # --- snapshots -----------------------------------------------------------------------

    def values(self) -> tuple[int | None, ...]:
        bpt = self.bpt
        return (
            self.capacity, self.reserved * bpt, self.used * bpt,
            (self.limit - self.used) * bpt, (self.capacity_tokens - self.reserved) * bpt,
            self.arena.largest * bpt, 0, None, self.allocs, self.frees, self.copied,
            self.allocs - self.frees,
        )

    def take_load_s(self) -> float:
        return 0.0

    def swap_out(self, seq: Seq, committed: int) -> bool:
        return False

    def held(self) -> tuple[int, ...]:
        return ()

    def mark(self) -> tuple[int | None, ...]:
        """What :meth:`stats` reads, as it is now."""
        return self.values()

    def stats(self, mark: tuple[Any, ...] | None = None) -> KVStats:
        """The KV snapshot now, or as ``mark`` found it."""
        v = self.values() if mark is None else mark
        return KVStats(
            capacity_bytes=v[0], used_bytes=v[2], reserved_bytes=v[1],
            reserved_ahead_bytes=v[3], free_bytes=v[4], largest_free_bytes=v[5],
            shared_bytes=v[6], block_allocs=v[8], block_frees=v[9], copied_bytes=v[10],
            page_table_entries=v[11],
        )

    def free_now(self) -> tuple[int, int]:
        return (self.capacity_tokens - self.reserved) * self.bpt, self.arena.largest * self.bpt

    def shared_tokens(self) -> int:
        return 0

    def prepare(self, seqs: list[Seq]) -> None:
        """Nothing: no prefix cache to look prompts up in."""

    def waiting_hashes(self, seq: Seq) -> set[int] | None:
        return None

    # --- quiet stretches -----------------------------------------------------------------

    def room(self, step: int, max_steps: int, keep_cached: bool,
             plan: list[tuple[int, list[Seq]]], before: np.ndarray | None) -> int:
        return max_steps

    def fill_stop(self, step: int, steps: int, avoid: set[int]) -> int:
        return steps

    def quiet(self, step: int, steps: int, n: int
              ) -> tuple[np.ndarray | None, np.ndarray | None, None]:
        """Decoders write into their extents: nothing is taken."""
        self.used += n * steps
        return None, None, None

    # --- compaction ----------------------------------------------------------------------

    def _defrag_if_fragmented(self, step: int) -> None:
        if self.auto_defrag is None:
            return
        free = self.capacity_tokens - self.reserved
        if free > 0 and self.arena.largest < self.auto_defrag * free:
            self._compact(step)

    def _compact(self, step: int) -> None:
        """Slide every extent left in address order (as the manager's ``_compact``),
        copying the slots each holds written."""
        cursor = 0
        for seq in sorted(self.live, key=lambda q: q.start):
            if seq.start != cursor:
                written = seq.computed_at(step)
                if written:
                    self.copies.append(SlotCopy(src=seq.start, dst=cursor, num_slots=written))
                    self.copied += written * self.bpt
                seq.start = cursor
            cursor += seq.length
        self.arena.reset(cursor)
