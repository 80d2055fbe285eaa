"""Segmented layout (the field reports' P3): a contiguous head plus a paged tail.

The pool is ``num_blocks`` blocks of ``block_size`` slots in one block-granular arena. At
admission a sequence reserves its head, one run of consecutive blocks holding its first
``head_tokens`` tokens (fewer when the request's prompt plus output is shorter: the length
is known at admission, as a request's ``max_tokens`` is), first fit from the low end.
Tokens past the head go into single blocks taken on demand from the high end, as in paged
attention. A head is a run of consecutive block ids, so the attention layout is still a
block table (no kernel change); the head counts as one page-table entry (an extent
descriptor), each tail block as one.

Both kinds of fragmentation exist and are reported honestly. External: a head needs a run
of free blocks, and tail blocks scattered through the arena break runs, so a head can wait
although enough blocks are free; ``largest_free_bytes`` is the longest free run, so the
fragmentation index is that over the free bytes. Internal: head room not yet written counts
as reserved for tokens still to come (``reserved_ahead_bytes``: the summary's reservation
waste), the last block's slots past the final token and spare heads' rounding as waste
that will never hold KV (internal waste).

Parallel samples reserve all their heads at admission (so a fork cannot fail); a fork
copies the parent's head into the child's and shares its tail blocks, copying a shared
partial block before writing it. No prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Self

import numpy as np
from pydantic import Field

from kvbench.engines.base import KVStats
from kvbench.engines.config import EngineConfig, EngineSettings, KVPolicy
from kvbench.engines.kv.arena import Arena
from kvbench.engines.kv.base import KVManager, SlotCopy, newly_computed, steps_within
from kvbench.engines.kv.spec import Footprint, KVSpec
from kvbench.engines.sequence import Sequence
from kvbench.errors import KvbenchError
from kvbench.kernels.layouts import BlockTables
from kvbench.workloads.model import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SegmentedPolicy(KVPolicy):
    """A contiguous head of ``head_tokens`` per sequence, the rest in ``block_size`` blocks
    (the run's block size unless set)."""

    kind: Literal["segmented"] = "segmented"
    summary = "contiguous head (first 2048 tokens, reserved at admission) + paged tail blocks"
    head_tokens: int = Field(default=2048, ge=1)
    block_size: int | None = Field(default=None, ge=1)

    def resolved(self, settings: EngineSettings) -> Self:
        return self.model_copy(update={"block_size": self.block_size or settings.block_size})

    def page_tokens(self) -> int:
        assert self.block_size is not None, "resolve the section first"
        return self.block_size

    def label(self) -> str:
        return f"segmented/head{self.head_tokens}" + (
            f"/bs{self.block_size}" if self.block_size else "")

    def check(self, config: EngineConfig) -> list[str]:
        if self.head_tokens % config.kv.page_tokens:
            raise KvbenchError(
                f"segmented: head_tokens {self.head_tokens} must be a multiple of the block "
                f"size {config.kv.page_tokens}, so that a head is a run of whole blocks"
            )
        return []

    def footprint(self, config: EngineConfig, request: Request) -> Footprint:
        return segmented_footprint(request, config.kv.page_tokens, self.head_tokens,
                                   config.num_pages)

    def manager(self, config: EngineConfig) -> SegmentedKVManager:
        return SegmentedKVManager(
            config.num_pages, config.kv.page_tokens, config.kv.bytes_per_token,
            config.scheduler.max_model_len, head_tokens=self.head_tokens, dtype=config.kv.dtype,
        )


def segmented_footprint(request: Request, block_size: int, head_tokens: int,
                        num_blocks: int) -> Footprint:
    """Every sample's head (reserved together) plus one sample's tail at its longest."""
    total = _cdiv(request.prompt_tokens + request.output_tokens, block_size)
    head = min(head_tokens // block_size, total)
    blocks = request.n * head + total - head
    samples = f"{request.n} heads of {head} blocks" if request.n > 1 else f"a head of {head}"
    return Footprint(
        tokens=blocks * block_size, capacity_tokens=num_blocks * block_size,
        what=f"{samples} + {total - head} tail blocks of {block_size} tokens",
        capacity=f"{num_blocks} blocks",
    )


@dataclass(slots=True)
class _Segments:
    """A live sequence's head (blocks ``head .. head + head_blocks - 1``) and tail blocks."""

    head: int
    head_blocks: int
    final_len: int  # tokens whose KV it writes by the end (the last sampled one gets none)
    tail: list[int] = field(default_factory=list)
    num_committed: int = 0

    def room(self, block_size: int) -> int:
        return (self.head_blocks + len(self.tail)) * block_size

    def table(self) -> list[int]:
        return [*range(self.head, self.head + self.head_blocks), *self.tail]


class SegmentedKVManager(KVManager):
    """Contiguous heads and paged tails over ``num_blocks`` blocks of ``block_size`` slots."""

    kind = "segmented"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_token: int,
        max_model_len: int,
        head_tokens: int = 2048,
        dtype: str | None = None,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("bytes_per_token", bytes_per_token),
                            ("max_model_len", max_model_len), ("head_tokens", head_tokens)):
            if value <= 0:
                raise KvbenchError(f"segmented KV cache: {name} must be positive, got {value}")
        if head_tokens % block_size:
            raise KvbenchError(
                f"segmented KV cache: head_tokens {head_tokens} is not a multiple of the "
                f"block size {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.head_tokens = head_tokens
        self.spec = KVSpec(block_size, bytes_per_token, dtype)
        self.max_model_len = max_model_len
        self.capacity_tokens = num_blocks * block_size
        self.arena = Arena(num_blocks, "first")
        self._free_blocks = num_blocks
        self._seqs: dict[int, _Segments] = {}
        self._spare: dict[int, list[_Segments]] = {}  # parent seq_id -> heads for its forks
        self._ref: dict[int, int] = {}  # tail block -> tables holding it
        self._shared = 0  # tail blocks held by more than one table
        self._forked: set[int] = set()
        self._copies: list[SlotCopy] = []
        self._used_tokens = 0
        self._sum_limit = 0  # over live sequences and spare heads: slots they will write
        self._sum_committed = 0
        self._entries = 0
        self._allocs = 0
        self._frees = 0
        self._copied_bytes = 0

    def footprint(self, request: Request) -> Footprint:
        return segmented_footprint(request, self.block_size, self.head_tokens, self.num_blocks)

    def held_tokens(self, prompt: int, output: int, n: int = 1) -> int:
        bs = self.block_size
        head = min(self.head_tokens, _cdiv(prompt + output, bs) * bs)
        return n * head + max(_cdiv(prompt + n * output, bs) * bs - head, 0)

    def lookup_prefix(self, seq: Sequence) -> int:
        return 0  # no prefix cache: heads are private

    def allocate(self, seq: Sequence, num_cached: int, num_new: int) -> bool:
        if seq.seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq.seq_id} is already allocated")
        if num_cached:
            raise RuntimeError("the segmented KV manager has no prefix cache")
        head_blocks, count, tail_blocks = self._needs(seq, num_new)
        if count * head_blocks + tail_blocks > self._free_blocks:
            return False
        heads = self._take_heads(head_blocks, count)
        if heads is None:
            return False
        final = seq.max_tokens - 1
        states = [_Segments(h, head_blocks, final) for h in heads]
        state = states[0]
        self._seqs[seq.seq_id] = state
        if count > 1:
            self._spare[seq.seq_id] = states[1:]
        self._free_blocks -= count * head_blocks
        self._allocs += count
        self._entries += count
        self._add_tail(state, tail_blocks)
        self._sum_limit += sum(self._limit(s) for s in states)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        return True

    def grow(self, seq: Sequence, num_new: int) -> bool:
        state = self._seqs[seq.seq_id]
        bs = self.block_size
        pos = seq.num_computed_tokens
        room = state.room(bs)
        index = pos // bs - state.head_blocks  # tail index of the block holding pos
        cow = (num_new > 0 and 0 <= index < len(state.tail)
               and self._ref[state.tail[index]] > 1)
        need = max(_cdiv(pos + num_new, bs) * bs - room, 0) // bs
        if not need and not cow:
            return True
        if need + cow > self._free_blocks:
            return False
        limit = self._limit(state)
        if cow:
            old = state.tail[index]
            (new,) = self._take_blocks(1)
            self._ref[old] -= 1
            if self._ref[old] == 1:
                self._shared -= 1
            state.tail[index] = new
            filled = pos % bs
            self._used_tokens += filled
            if filled:
                self._queue_copy(old * bs, new * bs, filled)
        self._add_tail(state, need)
        self._sum_limit += self._limit(state) - limit
        return True

    def commit(self, seq: Sequence) -> None:
        state = self._seqs[seq.seq_id]
        new = newly_computed(seq, state.num_committed, state.room(self.block_size), "segments")
        self._used_tokens += new
        self._sum_committed += new
        state.num_committed += new

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s head, tail and unforked spare heads (no-op if it holds none)."""
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            return
        bs = self.block_size
        self._forked.discard(seq.seq_id)
        for s in [state, *self._spare.pop(seq.seq_id, [])]:
            self._sum_limit -= self._limit(s)
            self._sum_committed -= s.num_committed
            self.arena.give(s.head, s.head_blocks)
            self._free_blocks += s.head_blocks
            self._used_tokens -= min(s.num_committed, s.head_blocks * bs)
            self._entries -= 1
            self._frees += 1
        head_room = state.head_blocks * bs
        freed = []
        for i, b in enumerate(state.tail):
            r = self._ref[b] - 1
            if r:
                self._ref[b] = r
                if r == 1:
                    self._shared -= 1
                continue
            del self._ref[b]
            freed.append(b)
            self._used_tokens -= min(max(state.num_committed - head_room - i * bs, 0), bs)
        self._give_blocks(freed)
        self._entries -= len(state.tail)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self._seqs:
            raise RuntimeError(f"sequence {child.seq_id} is already allocated")
        spare = self._spare.get(parent.seq_id)
        if not spare:
            raise RuntimeError(f"sequence {parent.seq_id} has no head reserved for a fork")
        state = spare.pop()
        if not spare:
            del self._spare[parent.seq_id]
        src, bs = self._seqs[parent.seq_id], self.block_size
        n = src.num_committed
        in_head = min(n, src.head_blocks * bs)
        if in_head:
            self._queue_copy(src.head * bs, state.head * bs, in_head)
        self._used_tokens += in_head
        # Share the tail blocks holding computed KV; room reserved beyond stays the parent's.
        shared = src.tail[: max(_cdiv(n, bs) - src.head_blocks, 0)]
        for b in shared:
            self._ref[b] += 1
            if self._ref[b] == 2:
                self._shared += 1
        self._sum_limit -= self._limit(state)
        state.tail = list(shared)
        state.num_committed = n
        self._sum_limit += self._limit(state)
        self._sum_committed += n
        self._entries += len(shared)
        self._seqs[child.seq_id] = state
        self._forked.update((parent.seq_id, child.seq_id))

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        state, bs = self._seqs[seq.seq_id], self.block_size
        if not 0 <= start <= end <= state.room(bs):
            raise RuntimeError(
                f"sequence {seq.seq_id}: positions [{start}, {end}) outside its "
                f"{state.room(bs)} slots"
            )
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(state.table(), dtype=np.int64)
        return table[pos // bs] * bs + pos % bs

    def block_table(self, seq: Sequence) -> list[int]:
        """``seq``'s head blocks then its tail blocks."""
        return self._seqs[seq.seq_id].table()

    def head(self, seq: Sequence) -> tuple[int, int]:
        """(first block, blocks) of ``seq``'s head."""
        state = self._seqs[seq.seq_id]
        return state.head, state.head_blocks

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> BlockTables:
        bs = self.block_size
        tables = np.zeros((len(seqs), int(-(-context_lens.max() // bs))), dtype=np.int32)
        for i, seq in enumerate(seqs):
            n = -(-int(context_lens[i]) // bs)
            tables[i, :n] = self._seqs[seq.seq_id].table()[:n]
        return BlockTables(tables, bs)

    def take_copies(self) -> list[SlotCopy]:
        copies, self._copies = self._copies, []
        return copies

    def stats(self) -> KVStats:
        """``largest_free_bytes`` is the longest run of free blocks (what a head needs), so
        largest/free is the external fragmentation of the heads; see the module for how
        internal waste splits into reserved-ahead and never-written slots."""
        bs, bpt = self.block_size, self.bytes_per_token
        block_bytes = bs * bpt
        shared = self._shared
        return KVStats(
            capacity_bytes=self.num_blocks * block_bytes,
            used_bytes=self._used_tokens * bpt,
            reserved_bytes=(self.num_blocks - self._free_blocks) * block_bytes,
            reserved_ahead_bytes=self._ahead_tokens() * bpt,
            free_bytes=self._free_blocks * block_bytes,
            largest_free_bytes=self.arena.largest * block_bytes,
            shared_bytes=shared * block_bytes,
            block_allocs=self._allocs,
            block_frees=self._frees,
            copied_bytes=self._copied_bytes,
            page_table_entries=self._entries,
        )

    # --- decode fast-forward ---------------------------------------------------------------

    def decode_room(self, seqs: list[Sequence], max_steps: int, keep_cached: bool = False) -> int:
        """Steps before a grow could fail or copy: a sequence past its room takes a tail
        block from the arena, so at most the free blocks between them; forked samples share
        tail blocks (copy-on-write), so they step one at a time."""
        if self._copies or self._forked:
            return 0
        bs, firsts = self.block_size, []
        for seq in seqs:
            state = self._seqs[seq.seq_id]
            if state.num_committed != seq.num_computed_tokens:
                return 0
            firsts.append(state.room(bs) - seq.num_computed_tokens)
        return steps_within(firsts, bs, max_steps, self._free_blocks)

    def advance_decode(self, seqs: list[Sequence], steps: int) -> dict[str, np.ndarray]:
        """Each step's grows take their tail blocks as :meth:`grow` would, in step and running
        order; the values they change hold from that step to the next such one."""
        bs, n = self.block_size, len(seqs)
        states = [self._seqs[s.seq_id] for s in seqs]
        takes: dict[int, list[_Segments]] = {}
        for state, seq in zip(states, seqs, strict=True):
            for j in range(state.room(bs) - seq.num_computed_tokens, steps, bs):
                takes.setdefault(j, []).append(state)
        at = [-1]  # the steps whose takes change the values below, after the values before
        values: list[tuple[int, int, int, int, int]] = []
        for j in [-1, *sorted(takes)]:
            for state in takes.get(j, ()):
                limit = self._limit(state)
                self._add_tail(state, 1)
                self._sum_limit += self._limit(state) - limit
            if j >= 0:
                at.append(j)
            values.append((self._free_blocks, self.arena.largest, self._allocs, self._entries,
                           self._sum_limit))
        step = np.arange(steps, dtype=np.int64)
        free, largest, allocs, entries, limits = np.asarray(values, dtype=np.int64)[
            np.searchsorted(np.asarray(at[1:], dtype=np.int64), step, side="right")].T
        bpt, block_bytes = self.bytes_per_token, bs * self.bytes_per_token
        committed = self._sum_committed + n * (step + 1)
        columns = {
            "used_bytes": (self._used_tokens + n * (step + 1)) * bpt,
            "reserved_bytes": (self.num_blocks - free) * block_bytes,
            "reserved_ahead_bytes": (limits - committed) * bpt,
            "free_bytes": free * block_bytes,
            "largest_free_bytes": largest * block_bytes,
            "block_allocs": allocs,
            "page_table_entries": entries,
        }
        self._used_tokens += n * steps
        self._sum_committed += n * steps
        for state in states:
            state.num_committed += steps
        return columns

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "head_tokens": self.head_tokens,
            "bytes_per_token": self.bytes_per_token,
            "max_model_len": self.max_model_len,
        }

    def would_admit(self, seq: Sequence, num_cached: int, num_new: int) -> bool | None:
        if seq.seq_id in self._seqs or num_cached:
            return None
        head_blocks, count, tail_blocks = self._needs(seq, num_new)
        if count * head_blocks + tail_blocks > self._free_blocks:
            return False
        trial = self.arena.copy()
        return all(trial.take(head_blocks) is not None for _ in range(count))

    def _needs(self, seq: Sequence, num_new: int) -> tuple[int, int, int]:
        """What admitting ``seq`` with ``num_new`` tokens takes: blocks per head, heads, and
        tail blocks."""
        bs = self.block_size
        head_blocks = min(self.head_tokens // bs, _cdiv(seq.max_tokens, bs))
        # Sample 0 before its prefill will fork the other samples right after it.
        count = seq.request.n if seq.sample_index == 0 and not seq.output_ids else 1
        return head_blocks, count, max(_cdiv(num_new, bs) - head_blocks, 0)

    def _take_heads(self, head_blocks: int, count: int) -> list[int] | None:
        """Starts of ``count`` heads of ``head_blocks`` blocks, all or none."""
        arena = self.arena.copy() if count > 1 else self.arena
        heads = []
        for _ in range(count):
            start = arena.take(head_blocks)
            if start is None:
                return None
            heads.append(start)
        self.arena = arena
        return heads

    def _take_blocks(self, n: int) -> list[int]:
        blocks = self.arena.take_top(n)
        assert len(blocks) == n, "caller checked the free blocks"
        self._ref.update(zip(blocks, [1] * n, strict=True))
        self._free_blocks -= n
        self._allocs += n
        return blocks

    def _give_blocks(self, blocks: list[int]) -> None:
        """Return tail blocks to the arena, a run of consecutive ones at a time (tails taken
        from the high end are mostly runs)."""
        if not blocks:
            return
        blocks.sort()
        start = prev = blocks[0]
        for b in blocks[1:]:
            if b != prev + 1:
                self.arena.give(start, prev - start + 1)
                start = b
            prev = b
        self.arena.give(start, prev - start + 1)
        self._free_blocks += len(blocks)
        self._frees += len(blocks)

    def _add_tail(self, state: _Segments, num_blocks: int) -> None:
        if num_blocks:
            state.tail += self._take_blocks(num_blocks)
            self._entries += num_blocks

    def _queue_copy(self, src: int, dst: int, num_slots: int) -> None:
        self._copies.append(SlotCopy(src=src, dst=dst, num_slots=num_slots))
        self._copied_bytes += num_slots * self.bytes_per_token

    def _limit(self, state: _Segments) -> int:
        return min(state.room(self.block_size), state.final_len)

    def _ahead_tokens(self) -> int:
        """Slots live sequences (and spare heads) will still write; a shared partial tail
        block is copied before anyone writes it, so its free slots count for no sharer."""
        total = self._sum_limit - self._sum_committed
        bs = self.block_size
        for seq_id in self._forked:
            state = self._seqs[seq_id]
            start = state.num_committed
            index = start // bs - state.head_blocks
            if start % bs and 0 <= index < len(state.tail) and self._ref[state.tail[index]] > 1:
                total -= min(bs - start % bs, self._limit(state) - start)
        return total
