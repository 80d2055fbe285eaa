"""Mixed page granularity (the field reports' P1): page sizes chosen by sequence length, in a
buddy allocator, with merges of adjacent small pages and optional migration.

Physical memory is an array of units of ``unit_tokens`` token slots. A page of class ``k`` is
a naturally aligned run of ``ratio**k`` units (:class:`~kvbench.engines.kv.buddy.BuddyPool`),
so kernels keep reading one unit size through a block table of units: no kernel change. A
sequence's new pages take the class of its length after the growth (``class_limits``: the
longest length of each class but the last). When a page of that class is not free and none
can be split off, smaller pages serve instead, so fragmentation costs page-table entries,
never admission.

The reports' sizes, in tokens: a 4 KB page is 16 tokens of one layer and one KV head at
head_dim 128 in fp16 (16 x 128 x 2 B), so the default unit is 16 tokens and 16 KB is 64
tokens (ratio 4: "four 4 KB pages merge into one 16 KB page"). Their "256 MB" large page, in
the same units, would be 65,536 units = 1,048,576 tokens, longer than any model's context,
so it cannot be a per-sequence page; read as bytes of the whole model it is 2048 tokens of
Llama-3-8B (128 KiB/token), the class threshold itself, and not a power-of-4 multiple of the
unit. The default third class is therefore the next buddy size, 256 tokens (64 KB per
layer-head); a fourth class (``class_limits`` with three entries) gives 1024-token pages.

``ratio`` consecutive pages of one class at the end of a sequence's table that are
physically adjacent and aligned merge into one page of the next class (one table entry);
with ``migrate`` they are moved into a fresh page of the next class when they are not,
once the sequence is long enough for that class, and the copies are real (SlotCopy) and
counted. Free pages split and coalesce in the pool. ``prewarm_pages`` keeps that many
smallest pages pre-split (split in the background, kept from coalescing). No prefix cache.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from kvbench.engines.base import KVStats
from kvbench.engines.config import EngineConfig, KVPolicy
from kvbench.engines.kv.base import (
    KVManager,
    SlotCopy,
    newly_computed,
    steps_to_end,
    written_columns,
)
from kvbench.engines.kv.buddy import BuddyPool
from kvbench.engines.kv.paged import paged_footprint
from kvbench.engines.kv.spec import Footprint, KVSpec
from kvbench.engines.sequence import Sequence
from kvbench.errors import KvbenchError
from kvbench.kernels.layouts import BlockTables
from kvbench.workloads.model import Request


class PagedMixedPolicy(KVPolicy):
    """Pages of ``unit_tokens x ratio**k`` tokens by sequence length over a buddy pool."""

    kind: Literal["paged-mixed"] = "paged-mixed"
    summary = (
        "mixed page sizes by length (buddy: 16/64/256 tokens = the reports' 4 KB/16 KB pages of "
        "one layer-head; their '256 MB' is no per-sequence page), merges, splits, migration"
    )
    unit_tokens: int = Field(default=16, ge=1)
    ratio: int = Field(default=4, ge=2)
    class_limits: tuple[int, ...] = (511, 2048)
    migrate: bool = False
    prewarm_pages: int = Field(default=0, ge=0)

    @field_validator("class_limits")
    @classmethod
    def _increasing(cls, limits: tuple[int, ...]) -> tuple[int, ...]:
        if any(b <= a for a, b in pairwise(limits)) or (limits and limits[0] < 1):
            raise ValueError("class_limits must be positive and increasing, e.g. [511, 2048]")
        return limits

    def page_tokens(self) -> int:
        return self.unit_tokens

    def label(self) -> str:
        sizes = "/".join(str(self.unit_tokens * self.ratio**k)
                         for k in range(len(self.class_limits) + 1))
        extra = ("+migrate" if self.migrate else "") + (
            f"+prewarm{self.prewarm_pages}" if self.prewarm_pages else "")
        return f"paged-mixed/{sizes}{extra}"

    def footprint(self, config: EngineConfig, request: Request) -> Footprint:
        # Alone in the cache a sequence always fits when its units do: where a page of its
        # class is missing, smaller pages serve.
        return paged_footprint(request, self.unit_tokens, config.num_pages)

    def manager(self, config: EngineConfig) -> PagedMixedKVManager:
        return PagedMixedKVManager(
            config.num_pages, self.unit_tokens, config.kv.bytes_per_token,
            config.scheduler.max_model_len, ratio=self.ratio, class_limits=self.class_limits,
            migrate=self.migrate, prewarm_pages=self.prewarm_pages, dtype=config.kv.dtype,
        )


@dataclass(slots=True)
class _SeqPages:
    """A live sequence's pages in position order: page ``i`` starts at unit ``starts[i]``
    and has class ``classes[i]``; together they hold ``room`` token slots."""

    starts: list[int]
    classes: list[int]
    final_len: int  # tokens whose KV it writes by the end (the last sampled one gets none)
    room: int = 0
    num_committed: int = 0
    units: np.ndarray | None = field(default=None)  # the unit table, built when asked for


class PagedMixedKVManager(KVManager):
    """Bookkeeping of mixed-size pages over ``num_units`` units of ``unit_tokens`` slots."""

    kind = "paged-mixed"

    def __init__(
        self,
        num_units: int,
        unit_tokens: int,
        bytes_per_token: int,
        max_model_len: int,
        ratio: int = 4,
        class_limits: tuple[int, ...] = (511, 2048),
        migrate: bool = False,
        prewarm_pages: int = 0,
        dtype: str | None = None,
    ) -> None:
        for name, value in (("num_units", num_units), ("unit_tokens", unit_tokens),
                            ("bytes_per_token", bytes_per_token),
                            ("max_model_len", max_model_len)):
            if value <= 0:
                raise KvbenchError(f"paged-mixed KV cache: {name} must be positive, got {value}")
        self.unit_tokens = unit_tokens
        self.ratio = ratio
        self.class_limits = tuple(class_limits)
        self.migrate = migrate
        self.prewarm_pages = prewarm_pages
        self.spec = KVSpec(unit_tokens, bytes_per_token, dtype)
        self.max_model_len = max_model_len
        self.capacity_tokens = num_units * unit_tokens
        self.pool = BuddyPool(num_units, ratio, len(self.class_limits))
        self.page_tokens = [s * unit_tokens for s in self.pool.sizes]
        self._seqs: dict[int, _SeqPages] = {}
        self._ref: dict[int, int] = {}  # page start unit -> tables holding it
        self._copies: list[SlotCopy] = []
        self._forked: set[int] = set()
        self._used_tokens = 0
        self._sum_limit = 0  # over live sequences: min(room, final_len)
        self._sum_committed = 0
        self._entries = 0
        self._allocs = 0
        self._frees = 0
        self._merges = 0
        self._copied_bytes = 0
        self._migrated_bytes = 0

    # -- sizing ---------------------------------------------------------------------------

    def page_class(self, num_tokens: int) -> int:
        """The page class of a sequence holding ``num_tokens`` tokens."""
        return bisect_left(self.class_limits, num_tokens)

    def footprint(self, request: Request) -> Footprint:
        return paged_footprint(request, self.unit_tokens, self.pool.num_units)

    def held_tokens(self, prompt: int, output: int, n: int = 1) -> int:
        total = prompt + n * output
        page = self.page_tokens[self.page_class(total)]
        return -(-total // page) * page

    # -- the interface --------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence) -> int:
        return 0  # no prefix cache

    def allocate(self, seq: Sequence, num_cached: int, num_new: int) -> bool:
        if seq.seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq.seq_id} is already allocated")
        if num_cached:
            raise RuntimeError("the paged-mixed KV manager has no prefix cache")
        if num_new > self.pool.free_units * self.unit_tokens:
            return False
        state = _SeqPages([], [], seq.max_tokens - 1)
        self._seqs[seq.seq_id] = state
        self._extend(state, num_new)
        self._sum_limit += self._limit(state)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        return True

    def grow(self, seq: Sequence, num_new: int) -> bool:
        state = self._seqs[seq.seq_id]
        pos = seq.num_computed_tokens
        need = pos + num_new
        forked = num_new > 0 and seq.seq_id in self._forked
        shared = self._shared_page_at(state, pos) if forked else None
        deficit = need - state.room
        if deficit <= 0 and shared is None:
            return True  # the common decode step: room left in the last page
        cow = 0 if shared is None else self.page_tokens[state.classes[shared]]
        if max(deficit, 0) + cow > self.pool.free_units * self.unit_tokens:
            return False
        limit = self._limit(state)
        if shared is not None:
            self._copy_on_write(state, shared, pos)
        if deficit > 0:
            self._extend(state, need)
        self._sum_limit += self._limit(state) - limit
        return True

    def commit(self, seq: Sequence) -> None:
        state = self._seqs[seq.seq_id]
        new = newly_computed(seq, state.num_committed, state.room, "pages")
        self._used_tokens += new
        self._sum_committed += new
        state.num_committed += new

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s pages. A sequence holding none (never admitted) is a no-op."""
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            return
        self._sum_limit -= self._limit(state)
        self._sum_committed -= state.num_committed
        self._entries -= len(state.starts)
        self._forked.discard(seq.seq_id)
        pos = 0
        for start, cls in zip(state.starts, state.classes, strict=True):
            size = self.page_tokens[cls]
            if self._unref(start, cls):
                self._used_tokens -= min(max(state.num_committed - pos, 0), size)
            pos += size

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self._seqs:
            raise RuntimeError(f"sequence {child.seq_id} is already allocated")
        state = self._seqs[parent.seq_id]
        # Share only pages holding computed KV; room reserved beyond stays the parent's.
        starts, classes, room = [], [], 0
        for start, cls in zip(state.starts, state.classes, strict=True):
            if room >= state.num_committed:
                break
            starts.append(start)
            classes.append(cls)
            room += self.page_tokens[cls]
            self._ref[start] += 1
        child_state = _SeqPages(starts, classes, state.final_len, room, state.num_committed)
        self._seqs[child.seq_id] = child_state
        self._entries += len(starts)
        self._sum_limit += self._limit(child_state)
        self._sum_committed += child_state.num_committed
        self._forked.update((parent.seq_id, child.seq_id))

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        state = self._seqs[seq.seq_id]
        if not 0 <= start <= end <= state.room:
            raise RuntimeError(
                f"sequence {seq.seq_id}: positions [{start}, {end}) outside its "
                f"{state.room} slots"
            )
        u = self.unit_tokens
        pos = np.arange(start, end, dtype=np.int64)
        return self._units(state)[pos // u] * u + pos % u

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> BlockTables:
        u = self.unit_tokens
        tables = np.zeros((len(seqs), int(-(-context_lens.max() // u))), dtype=np.int32)
        for i, seq in enumerate(seqs):
            n = -(-int(context_lens[i]) // u)
            tables[i, :n] = self._units(self._seqs[seq.seq_id])[:n]
        return BlockTables(tables, u)

    def page_table(self, seq: Sequence) -> list[tuple[int, int]]:
        """(start unit, class) of each of ``seq``'s pages, in position order."""
        state = self._seqs[seq.seq_id]
        return list(zip(state.starts, state.classes, strict=True))

    def take_copies(self) -> list[SlotCopy]:
        copies, self._copies = self._copies, []
        return copies

    def background(self) -> None:
        pool = self.pool
        while pool.free_pages(0) < self.prewarm_pages and pool.split_one(0):
            pass

    # -- decode fast-forward ----------------------------------------------------------------

    def works_between_steps(self) -> bool:
        return self.prewarm_pages > 0

    def decode_room(self, seqs: list[Sequence], max_steps: int, keep_cached: bool = False) -> int:
        """Steps before a sequence writes past its pages: a new page may split, merge or
        migrate; pages shared by forks are copied on write, so forks step one at a time."""
        if self._copies or self._forked:
            return 0

        def held(seq: Sequence) -> tuple[int, int]:
            state = self._seqs[seq.seq_id]
            return state.num_committed, state.room

        return steps_to_end(seqs, max_steps, held)

    def advance_decode(self, seqs: list[Sequence], steps: int) -> dict[str, np.ndarray]:
        """Each step writes one slot per sequence into its pages: only the written slots
        change."""
        n = len(seqs)
        for seq in seqs:
            self._seqs[seq.seq_id].num_committed += steps
        columns = written_columns(n, steps, self.bytes_per_token, self._used_tokens,
                                  self._sum_committed, self._sum_limit)
        self._used_tokens += n * steps
        self._sum_committed += n * steps
        return columns

    def stats(self) -> KVStats:
        """Bytes count whole pages except ``used_bytes`` (written slots of pages some live
        sequence holds, each page once) and ``reserved_ahead_bytes`` (slots live sequences
        will still write). ``largest_free_bytes`` is the longest run of adjacent free pages
        of the largest class, so largest/free says how much free memory large pages can
        use; ``merges`` counts pages joined in tables (migrations included), ``splits``
        free pages split."""
        bpt, unit_bytes = self.bytes_per_token, self.unit_tokens * self.bytes_per_token
        pool = self.pool
        return KVStats(
            capacity_bytes=pool.num_units * unit_bytes,
            used_bytes=self._used_tokens * bpt,
            reserved_bytes=(pool.num_units - pool.free_units) * unit_bytes,
            reserved_ahead_bytes=self._ahead_tokens() * bpt,
            free_bytes=pool.free_units * unit_bytes,
            largest_free_bytes=pool.largest_free_run_units * unit_bytes,
            shared_bytes=self._shared_units() * unit_bytes,
            block_allocs=self._allocs,
            block_frees=self._frees,
            copied_bytes=self._copied_bytes,
            page_table_entries=self._entries,
            merges=self._merges,
            splits=pool.splits,
            migrated_bytes=self._migrated_bytes,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_units": self.pool.num_units,
            "unit_tokens": self.unit_tokens,
            "page_tokens": self.page_tokens,
            "class_limits": list(self.class_limits),
            "bytes_per_token": self.bytes_per_token,
            "max_model_len": self.max_model_len,
            "migrate": self.migrate,
            "prewarm_pages": self.prewarm_pages,
        }

    # -- pages ----------------------------------------------------------------------------

    def _extend(self, state: _SeqPages, need: int) -> None:
        """Append pages until ``state`` holds ``need`` slots (caller checked free room):
        pages of the class of ``need``, or the largest smaller class left."""
        cls = self.page_class(need)
        pool = self.pool
        self._merge_tail(state, cls)  # the sequence may have just outgrown its pages' class
        while state.room < need:
            k = min(cls, pool.max_free_order())
            start = pool.take(k)
            assert start is not None, "caller checked the free room"
            self._append(state, start, k)
            self._merge_tail(state, cls)
        state.units = None

    def _append(self, state: _SeqPages, start: int, cls: int) -> None:
        state.starts.append(start)
        state.classes.append(cls)
        state.room += self.page_tokens[cls]
        self._ref[start] = 1
        self._entries += 1
        self._allocs += 1

    def _merge_tail(self, state: _SeqPages, target: int) -> None:
        """Join the last ``ratio`` pages while they are one class below the largest and all
        this sequence's own: in place when adjacent and aligned, else (with ``migrate``, once
        the sequence's class ``target`` is above theirs) by moving them into a new page."""
        r, pool, starts, classes = self.ratio, self.pool, state.starts, state.classes
        while len(starts) >= r:
            k = classes[-1]
            if k >= pool.top or any(c != k for c in classes[-r:]):
                return
            group = starts[-r:]
            if any(self._ref[s] > 1 for s in group):
                return
            if pool.can_join(group, k):
                for s in group[1:]:
                    del self._ref[s]
                new = group[0]
            elif self.migrate and target > k and pool.max_free_order() > k:
                new = pool.take(k + 1)
                assert new is not None
                self._migrate(state, group, k, new)
            else:
                return
            del starts[-r:], classes[-r:]
            starts.append(new)
            classes.append(k + 1)
            self._ref[new] = 1
            self._entries -= r - 1
            self._merges += 1

    def _migrate(self, state: _SeqPages, group: list[int], cls: int, new: int) -> None:
        """Copy the written slots of the last pages ``group`` (class ``cls``) into the page
        at unit ``new`` and free them."""
        u, size = self.unit_tokens, self.page_tokens[cls]
        first_pos = state.room - len(group) * size
        for i, start in enumerate(group):
            filled = min(max(state.num_committed - (first_pos + i * size), 0), size)
            if filled:
                self._queue_copy(start * u, new * u + i * size, filled)
                self._migrated_bytes += filled * self.bytes_per_token
            del self._ref[start]
            self.pool.give(start, cls, self.prewarm_pages)
            self._frees += 1
        self._allocs += 1

    def _copy_on_write(self, state: _SeqPages, index: int, pos: int) -> None:
        """Give ``state`` private pages in place of its shared page ``index`` (which holds
        position ``pos``), copying the slots written before ``pos``."""
        cls, old = state.classes[index], state.starts[index]
        size, u = self.page_tokens[cls], self.unit_tokens
        page_pos = sum(self.page_tokens[c] for c in state.classes[:index])
        self._unref(old, cls)
        pages: list[tuple[int, int]] = []
        room = 0
        while room < size:  # the same slots, in pages no larger than the old one
            k = min(cls, self.pool.max_free_order())
            start = self.pool.take(k)
            assert start is not None, "caller checked the free room"
            self._ref[start] = 1
            self._allocs += 1
            pages.append((start, k))
            room += self.page_tokens[k]
        filled = pos - page_pos
        offset = 0
        for start, k in pages:
            n = min(filled - offset, self.page_tokens[k])
            if n > 0:
                self._queue_copy(old * u + offset, start * u, n)
            offset += self.page_tokens[k]
        self._used_tokens += filled
        state.starts[index : index + 1] = [s for s, _ in pages]
        state.classes[index : index + 1] = [k for _, k in pages]
        self._entries += len(pages) - 1
        state.units = None

    def _shared_page_at(self, state: _SeqPages, pos: int) -> int | None:
        """Index of the page holding position ``pos`` when another table shares it."""
        p = 0
        for i, (start, cls) in enumerate(zip(state.starts, state.classes, strict=True)):
            size = self.page_tokens[cls]
            if pos < p + size:
                return i if self._ref[start] > 1 else None
            p += size
        return None

    def _unref(self, start: int, cls: int) -> bool:
        """Drop one reference to a page; True when that freed it."""
        r = self._ref[start] - 1
        if r:
            self._ref[start] = r
            return False
        del self._ref[start]
        self.pool.give(start, cls, self.prewarm_pages)
        self._frees += 1
        return True

    def _queue_copy(self, src: int, dst: int, num_slots: int) -> None:
        self._copies.append(SlotCopy(src=src, dst=dst, num_slots=num_slots))
        self._copied_bytes += num_slots * self.bytes_per_token

    def _units(self, state: _SeqPages) -> np.ndarray:
        if state.units is None:
            sizes = self.pool.sizes
            state.units = np.concatenate([
                np.arange(s, s + sizes[c], dtype=np.int64)
                for s, c in zip(state.starts, state.classes, strict=True)
            ]) if state.starts else np.zeros(0, dtype=np.int64)
        return state.units

    def _limit(self, state: _SeqPages) -> int:
        return min(state.room, state.final_len)

    def _ahead_tokens(self) -> int:
        """Slots live sequences' pages hold for tokens still to be written; a shared partial
        page is copied before anyone writes it, so its free slots count for no sharer."""
        total = self._sum_limit - self._sum_committed
        for seq_id in self._forked:
            state = self._seqs[seq_id]
            start = state.num_committed
            i = self._shared_page_at(state, start)
            if i is not None:
                page_end = sum(self.page_tokens[c] for c in state.classes[: i + 1])
                if start < page_end and start > page_end - self.page_tokens[state.classes[i]]:
                    total -= min(page_end - start, self._limit(state) - start)
        return total

    def _shared_units(self) -> int:
        if not self._forked:
            return 0
        sizes = self.pool.sizes
        seen: dict[int, int] = {}
        for seq_id in self._forked:
            state = self._seqs[seq_id]
            for s, c in zip(state.starts, state.classes, strict=True):
                if self._ref[s] > 1:
                    seen[s] = sizes[c]
        return sum(seen.values())
