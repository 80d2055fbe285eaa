"""Paged KV bookkeeping of the event replay: the paged manager's
(:mod:`kvbench.engines.kv.paged`) block tables, pool and prefix cache, with decoding
sequences held lazily.

A decoding sequence takes a block when the position it computes starts one (``s + c`` a
multiple of the block size) and fills one a step before the next starts, so the decoders
are grouped by ``c`` modulo the block size: the group of step ``s`` is all that step's
allocations, and the group before it all its prefix-cache entries. Groups keep the running
order (a sequence joins when its prefill ends, and prefills end in admission order).

A block a decoder fills holds tokens the simulator sampled for that request, which no other
request's tokens match (they are drawn from its id), so only that request could ever find
it again, and only after a preemption. Such a block is cached under a placeholder key (its
id, negated: unique and never looked up) and gets its content's key when its sequence is
preempted, before anyone can look it up; hashing every generated block would cost more than
the rest of its bookkeeping.

Offload tiers (:mod:`kvbench.engines.kv.offload`) are the manager's own: evicted blocks go
down to them, a lookup goes on through them, and an admission loads what it found there.
A placeholder-keyed block goes down under a key of its own (the pool's, which no lookup
asks for), where it takes its room as the block it stands for would. For tiers that rank
blocks (``lfu`` by prefix hits, ``cost`` by depth too), an evicted block goes down with the
hits the pool counted for it, and its depth, which the book keeps (as the tiers keep it on
the step path).

Only what the replay supports is kept: one sample per request (no forks, so no
copy-on-write and a block is shared only through a prefix hit), no sliding-window release.
A sequence preempted with swap preemption has its blocks copied to the
first tier and resumes where it stopped, as :meth:`PagedKVManager.swap_out` has it."""

from __future__ import annotations

from array import array
from itertools import accumulate
from typing import Any

import numpy as np

from kvbench.engines.base import KVStats
from kvbench.engines.kv.hashing import ROOT_HASH, BlockHasher
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.sim.replay.pool import contents_digests, new_pool
from kvbench.engines.sim.replay.seq import Seq
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.workloads.model import key_hash

# Segments whose block digests are kept for the next prompts that share them.
_DIGESTS_KEPT = 1 << 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedBook:
    def __init__(self, manager: PagedKVManager, vocab_size: int) -> None:
        self.bs = bs = manager.block_size
        self.bpt = manager.bytes_per_token
        self.num_blocks = manager.num_blocks
        self.caching = manager.enable_prefix_caching
        self.block_bytes = self.page_bytes = bs * self.bpt
        self.page_tokens = bs
        self.capacity = self.num_blocks * self.block_bytes
        self.vocab = vocab_size
        self.footprint = manager.footprint
        self.pool = new_pool(manager.num_blocks, bs, manager.eviction)
        self.hasher = BlockHasher(bs)
        self.trace = manager.trace
        self.offload = manager.offload
        self.swaps = manager.swaps
        self.leaks = manager.leak_finished
        self.tier_kinds = tuple(t.kind for t in self.offload.tiers) if self.offload else ()
        # Tiers that rank blocks (or blocks that come back to LFU eviction here) are told an
        # evicted block's prefix hits, as the pool counts them; the cost rule, its depth.
        self.ranked = self.offload is not None and (manager.eviction == "lfu" or any(
            t.spec.eviction != "lru" for t in self.offload.tiers))
        self.depth = np.zeros(self.num_blocks, dtype=np.int64) if (
            self.offload is not None and self.offload.tracks_depth) else None
        self.used = self.sum_limit = self.sum_committed = self.entries = 0
        self.hit_tokens = self.query_tokens = 0
        self.groups: list[dict[Seq, None]] = [{} for _ in range(bs)]
        self._digests: dict[str, np.ndarray] = {}

    # --- decoding sequences ------------------------------------------------------------

    def join(self, seq: Seq) -> None:
        seq.phase = seq.c % self.bs
        self.groups[seq.phase][seq] = None

    def leave(self, seq: Seq) -> None:
        del self.groups[seq.phase][seq]

    def grows_at(self, step: int) -> list[Seq]:
        """The decoders whose position at ``step`` starts a block, in running order."""
        g = self.groups[-step % self.bs]
        return list(g) if g else []

    def grow_decoders(self, seqs: list[Seq]) -> None:
        """One block each (the caller checked they are free)."""
        bs = self.bs
        for seq, block in zip(seqs, self._take_blocks(len(seqs)), strict=True):
            table = seq.table
            assert table is not None
            m = len(table)
            table.append(block)
            f = seq.final_len
            self.sum_limit += min((m + 1) * bs, f) - min(m * bs, f)
        self.entries += len(seqs)

    def advance(self, tokens: int) -> None:
        """Decoders wrote ``tokens`` more KV slots (one each a step)."""
        self.used += tokens
        self.sum_committed += tokens

    def fill_decoders(self, step: int) -> None:
        """Cache the blocks decoders filled at ``step``, in running order."""
        g = self.groups[(-step - 1) % self.bs]
        if g and self.caching:
            self._cache_fills(list(g))

    def _cache_fills(self, seqs: list[Seq]) -> None:
        """Cache the next block of each of ``seqs`` (full now), under a placeholder key
        unless its content's key is already known."""
        blocks, known = [], []
        depth = self.depth
        for seq in seqs:
            b, hashes = seq.indexed, seq.hashes
            block = seq.table[b]  # type: ignore[index]
            if hashes is not None and b < len(hashes):
                known.append((block, hashes[b]))
            else:
                blocks.append(block)
            if depth is not None:
                depth[block] = b
            seq.indexed = b + 1
        if known:
            # A block its own earlier run filled before a preemption: its key is known.
            keys = [k for _, k in known]
            self._discard(keys)
            self.pool.cache([b for b, _ in known], keys, 0, len(known))
            self.trace.write(keys)
        if blocks:
            self.pool.cache_placeholders(blocks)

    # --- prefill, admission and release ------------------------------------------------

    def fresh(self, seq: Seq, pos: int, num_new: int) -> int:
        return max(_cdiv(pos + num_new, self.bs) - len(seq.table), 0)  # type: ignore[arg-type]

    def fits(self, blocks: int) -> bool:
        return blocks <= self.pool.num_free

    def grow(self, seq: Seq, pos: int, num_new: int) -> bool:
        table = seq.table
        assert table is not None
        bs = self.bs
        num_fresh = _cdiv(pos + num_new, bs) - len(table)
        if num_fresh <= 0:
            return True
        if num_fresh > self.pool.num_free:
            return False
        f = seq.final_len
        before = min(len(table) * bs, f)
        table += self._take_blocks(num_fresh)
        self.entries += num_fresh
        self.sum_limit += min(len(table) * bs, f) - before
        return True

    def lookup(self, seq: Seq) -> tuple[int, list[int]]:
        """Cached leading tokens of ``seq`` and the blocks holding them (none for a private
        prompt that never ran: no block can hold it)."""
        if seq.swapped:  # back where it stopped: the leading blocks still cached serve
            full = seq.computed // self.bs
            return seq.computed, self.pool.lookup(self._hashes_upto(seq, full)[:full])
        if not self._findable(seq):
            return 0, []
        n = seq.num_tokens
        hashes = self._hashes_upto(seq, n // self.bs)
        limit = (n - 1) // self.bs
        hits = self.pool.lookup(hashes[:limit])
        found = len(hits)
        if self.offload is not None and found < limit:
            found += self.offload.run(hashes[found:limit])
        return found * self.bs, hits

    def would_admit(self, seq: Seq, cached: int, hits: list[int], num_new: int) -> bool:
        num_fresh = _cdiv(cached + num_new, self.bs) - len(hits)
        return num_fresh + self.pool.count_free(hits) <= self.pool.num_free

    def allocate(self, seq: Seq, cached: int, hits: list[int], num_new: int, step: int) -> bool:
        if seq.swapped:
            return self._swap_in(seq, cached, hits, num_new)
        bs, pool = self.bs, self.pool
        num_fresh = _cdiv(cached + num_new, bs) - len(hits)
        if num_fresh + pool.count_free(hits) > pool.num_free:
            return False
        self.used += pool.touch(hits) * bs
        # Blocks found below device memory move up into fresh blocks, findable again.
        want = cached // bs
        below = seq.hashes[len(hits) : want] if want > len(hits) else None  # type: ignore[index]
        if below is not None:
            loaded = self.offload.load(below, len(hits))  # type: ignore[union-attr]
        fresh = self._take_blocks(num_fresh)
        table = hits + fresh if hits else fresh
        if below is not None:
            pool.cache(table, seq.hashes, len(hits), want)  # type: ignore[arg-type]
            self.used += len(below) * bs
            self._note_depths(table[len(hits) : want], len(hits))
            pool.set_hits(table[len(hits) : want], [h + 1 for h in loaded])
        seq.table = table
        seq.indexed = want
        self.entries += len(table)
        self.sum_limit += min(len(table) * bs, seq.final_len)
        self.sum_committed += cached
        if self.caching:
            self.hit_tokens += cached
            self.query_tokens += seq.num_tokens
            if self._findable(seq):
                limit = (seq.num_tokens - 1) // bs
                self.trace.lookup(self._hashes_upto(seq, limit)[:limit])
            if below is not None:
                self.trace.write(below)
        return True

    def commit(self, seq: Seq, before: int, after: int) -> None:
        """``seq`` (not decoding) computed tokens ``[before, after)``."""
        self.used += after - before
        self.sum_committed += after - before
        if self.caching:
            full = after // self.bs
            indexed = seq.indexed
            if full > indexed:
                self._note_depths(seq.table[indexed:full], indexed)  # type: ignore[index]
                if seq.private:
                    # Keyed where its keys are known (from a run before a preemption), else
                    # under placeholders: only its own lookup could find them.
                    known = min(len(seq.hashes) if seq.hashes is not None else 0, full)
                    if known > indexed:
                        self._discard(seq.hashes[indexed:known])  # type: ignore[index]
                        self.pool.cache(seq.table, seq.hashes, indexed,  # type: ignore[arg-type]
                                        known)
                        self.trace.write(seq.hashes[indexed:known])  # type: ignore[index]
                    self.pool.cache_placeholders(seq.table[max(known, indexed) : full])  # type: ignore[index]
                else:
                    hashes = self._hashes_upto(seq, full)
                    self._discard(hashes[indexed:full])
                    self.pool.cache(seq.table, hashes, indexed, full)  # type: ignore[arg-type]
                    self.trace.write(hashes[indexed:full])
                seq.indexed = full

    def free(self, seq: Seq, finished: bool, committed: int, step: int) -> None:
        table = seq.table
        assert table is not None
        if finished:
            seq.hashes = None
        elif self.caching:
            # Preempted: it may look its blocks up again, so they get their content's keys.
            known = len(seq.hashes) if seq.hashes is not None else 0
            if seq.indexed > known:
                hashes = self._hashes_upto(seq, seq.indexed)
                self.pool.rekey(table[known : seq.indexed], hashes[known:])
            if seq.indexed:
                self.trace.write(seq.hashes[: seq.indexed])  # type: ignore[index]
        self.sum_limit -= min(len(table) * self.bs, seq.final_len)
        self.sum_committed -= committed
        self.entries -= len(table)
        release = self.pool.leak if finished and self.leaks else self.pool.release
        self.used -= release(table, committed)
        seq.table = None

    def take_copies(self) -> list[SlotCopy]:
        return []

    def take_load_s(self) -> float:
        return self.offload.take_load_s() if self.offload is not None else 0.0

    # --- swap preemption -----------------------------------------------------------------

    def swap_out(self, seq: Seq, committed: int) -> bool:
        """Copy preempted ``seq``'s blocks holding its ``committed`` tokens to the first
        tier (before :meth:`free`); False where it is recomputed instead."""
        n = _cdiv(committed, self.bs)
        if not (self.swaps and n):
            return False
        return self.offload.swap_out(seq.rid, seq.table[:n])  # type: ignore[union-attr,index]

    def _swap_in(self, seq: Seq, cached: int, hits: list[int], num_new: int) -> bool:
        """Resume swapped ``seq``: ``hits`` (its leading blocks still cached) attached, its
        other ``cached`` tokens copied back into fresh blocks and findable again."""
        bs, pool = self.bs, self.pool
        num_fresh = _cdiv(cached + num_new, bs) - len(hits)
        if num_fresh + pool.count_free(hits) > pool.num_free:
            return False
        self.used += pool.touch(hits) * bs + cached - len(hits) * bs
        fresh = self._take_blocks(num_fresh)
        table = hits + fresh if hits else fresh
        self.offload.swap_in(seq.rid, table[len(hits) : _cdiv(cached, bs)])  # type: ignore[union-attr]
        seq.table = table
        self.entries += len(table)
        self.sum_limit += min(len(table) * bs, seq.final_len)
        self.sum_committed += cached
        seq.indexed, full = len(hits), cached // bs
        if full > len(hits):
            hashes = self._hashes_upto(seq, full)
            self._note_depths(table[len(hits) : full], len(hits))
            self._discard(hashes[len(hits) : full])
            pool.cache(table, hashes, len(hits), full)  # type: ignore[arg-type]
            self.trace.write(hashes[len(hits) : full])
            seq.indexed = full
        return True

    # --- offload tiers -------------------------------------------------------------------

    def _take_blocks(self, n: int) -> list[int]:
        """``n`` blocks from the pool, the cached blocks it evicts going down to the
        tiers."""
        plain = self.pool.num_plain_free
        if self.offload is None or n <= plain:
            return self.pool.take(n)
        evicted, hits = array("Q"), array("q") if self.ranked else None
        blocks = self.pool.take(n, evicted, hits)
        self._store(evicted, blocks[plain:], hits)
        return blocks

    def _store(self, evicted: array, blocks: Any, hits: array | None) -> None:
        """Evicted ``blocks``' keys (and ``hits``) into the first tier."""
        if not evicted:
            return
        depths = self.depth[np.asarray(blocks, dtype=np.int64)].tolist() if (
            self.depth is not None) else None
        self.offload.store([], evicted, hits.tolist() if hits is not None else None,  # type: ignore[union-attr]
                           depths)

    def _note_depths(self, blocks: Any, first: int) -> None:
        """``blocks`` cached at depths ``first``, ``first`` + 1, ... (the cost rule prices
        recomputing an evicted block by its depth)."""
        if self.depth is not None and len(blocks):
            self.depth[np.asarray(blocks, dtype=np.int64)] = np.arange(first, first + len(blocks))

    def _discard(self, keys: np.ndarray | list[int]) -> None:
        """Keys cached on the device afresh: copies held below are superseded."""
        if self.offload is not None and len(keys):
            self.offload.discard(keys)

    def held(self) -> tuple[int, ...]:
        """The bytes each tier holds now (none without tiers)."""
        return self.offload.held_bytes() if self.offload is not None else ()

    def copies_pending(self) -> bool:
        return False

    # --- snapshots -----------------------------------------------------------------------

    def values(self) -> tuple[int, ...]:
        """The KVStats fields a step logs, from capacity to page-table entries."""
        pool, bpt = self.pool, self.bpt
        free = pool.num_free * self.block_bytes
        return (
            self.capacity, self.capacity - free, self.used * bpt,
            (self.sum_limit - self.sum_committed) * bpt, free, free,
            pool.num_shared * self.block_bytes, self.hit_tokens if self.caching else None,
            pool.num_allocs, pool.num_frees, 0, self.entries,
        )

    def mark(self) -> tuple[Any, ...]:
        """What :meth:`stats` reads, as it is now."""
        tiers = self.offload.kv_fields() if self.offload is not None else {}
        return *self.values(), self.query_tokens, self.pool.num_evictions, tiers

    def stats(self, mark: tuple[Any, ...] | None = None) -> KVStats:
        """The KV snapshot now, or as ``mark`` found it."""
        v = self.mark() if mark is None else mark
        caching = self.caching
        return KVStats(
            capacity_bytes=v[0], used_bytes=v[2], reserved_bytes=v[1],
            reserved_ahead_bytes=v[3], free_bytes=v[4], largest_free_bytes=v[5],
            shared_bytes=v[6], prefix_hit_tokens=v[7],
            prefix_query_tokens=v[12] if caching else None,
            block_allocs=v[8], block_frees=v[9], copied_bytes=v[10], page_table_entries=v[11],
            evictions=v[13] if caching else None, **v[14],
        )

    def free_now(self) -> tuple[int, int]:
        """Free bytes and the largest run of them (any free block serves any request)."""
        free = self.pool.num_free * self.block_bytes
        return free, free

    def shared_tokens(self) -> int:
        """Token slots live sequences hold more than once: a block held by ``r`` tables
        counts ``r - 1`` extra times, and with one sample per request only full blocks (a
        prefix hit's) are shared. Leaked blocks no table holds are neither free nor held."""
        held = self.num_blocks - self.pool.num_free - self.pool.num_lost
        return self.bs * (self.entries - held)

    def prepare(self, seqs: list[Seq]) -> None:
        """Key the prompt blocks of sequences about to arrive, all in one pass: their
        admission looks them up, and one numpy pass per prompt costs more than the rest of
        its bookkeeping. A prompt whose segments all start at block boundaries (a Mooncake
        trace's 512-token blocks) takes its blocks' digests from its segments', kept by
        segment key: requests sharing segments hash them once."""
        todo = [s for s in seqs if s.hashes is None and not s.private]
        if not self.caching or not todo:
            return
        bs, kept = self.bs, self._digests
        aligned = [not any(g.tokens % bs for g in s.request.segments[:-1]) for s in todo]
        # The segments whose digests are not kept yet, at their longest here.
        need: dict[str, int] = {}
        for seq, ok in zip(todo, aligned, strict=True):
            if ok:
                for g in seq.request.segments:
                    n = g.tokens // bs
                    if n > need.get(g.key, 0) and (g.key not in kept or len(kept[g.key]) < n):
                        need[g.key] = n
        if need:
            keys = list(need)
            digests = contents_digests(np.fromiter(map(key_hash, keys), np.uint64, len(keys)),
                                       [need[k] * bs for k in keys], self.vocab, self.hasher)
            ends = np.cumsum([need[k] for k in keys]).tolist()
            for key, a, b in zip(keys, [0, *ends[:-1]], ends, strict=True):
                kept[key] = digests[a:b]
        parts: list[np.ndarray] = []
        counts = []
        for seq, ok in zip(todo, aligned, strict=True):
            n = seq.num_prompt // bs
            if ok:
                parts += [kept[g.key][: g.tokens // bs] for g in seq.request.segments
                          if g.tokens >= bs]
            else:
                parts.append(self.hasher.digests(seq.token_ids(0, n * bs, self.vocab)))
            counts.append(n)
        digests = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
        for seq, hashes in zip(todo, self.hasher.chain_each(
                digests, np.asarray(counts, dtype=np.int64)), strict=True):
            seq.hashes = hashes
        if len(kept) > _DIGESTS_KEPT:
            kept.clear()

    def waiting_hashes(self, seq: Seq) -> set[int] | None:
        if not self._findable(seq):
            return None
        return set(self._hashes_upto(seq, seq.num_tokens // self.bs).tolist())

    # --- quiet stretches -----------------------------------------------------------------

    def room(self, step: int, max_steps: int, keep_cached: bool,
             plan: list[tuple[int, list[Seq]]], before: np.ndarray | None) -> int:
        """Steps, up to ``max_steps``, whose allocations the free blocks cover (with
        ``keep_cached``, the plain ones: evicting a cached block could change what the
        request waiting at the head of the queue hits). ``plan``: decoders finishing at
        those steps (after ``step``), which take nothing after and return their blocks;
        ``before[j]``: the plan entries before step ``j``."""
        bs = self.bs
        counts = np.fromiter(map(len, self.groups), np.int64, bs)
        per_step = counts[-(step + np.arange(max_steps, dtype=np.int64)) % bs]
        room: int | np.ndarray = (self.pool.num_plain_free if keep_cached
                                  else self.pool.num_free)
        if plan:
            returns = []
            pool = self.pool
            for f, seqs in plan:
                freed = 0
                for seq in seqs:
                    j = -(step + seq.c) % bs  # its first step taking a block
                    taken = (f - j) // bs + 1 if j <= f else 0
                    per_step[j + taken * bs :: bs] -= 1
                    # What it holds alone goes free (with no block shared, all of it).
                    table = seq.table
                    freed += taken + (len(table) if not pool.num_shared  # type: ignore[arg-type]
                                      else pool.count_alone(table))  # type: ignore[arg-type]
                returns.append(freed)
            room = room + np.fromiter(accumulate(returns, initial=0), np.int64,
                                      len(returns) + 1)[before]
        short = per_step.cumsum() > room
        first = int(short.argmax())
        return first if short[first] else max_steps

    def fill_stop(self, step: int, steps: int, avoid: set[int]) -> int:
        """The first of ``steps`` steps that would make findable a block whose key is in
        ``avoid`` (only a block whose content's key is known can be), or ``steps``."""
        bs, groups = self.bs, self.groups
        nth: dict[Seq, int] = {}
        for j in range(steps):
            for seq in groups[(-(step + j) - 1) % bs]:
                b = nth.get(seq, seq.indexed)
                nth[seq] = b + 1
                hashes = seq.hashes
                if hashes is not None and b < len(hashes) and int(hashes[b]) in avoid:
                    return j
        return steps

    def quiet(self, step: int, steps: int, n: int
              ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """Apply ``steps`` steps of ``n`` decoders (within :meth:`room`). Returns the blocks
        taken and the slots their sequences will write added, through each step
        (cumulative; None when no block is taken), and the bytes each tier holds after each
        step (tiers by steps; None where blocks evicted on the way changed none)."""
        bs, groups = self.bs, self.groups
        takers: list[Seq] = []
        fills: list[Seq] = []
        at: list[int] = []
        caching = self.caching
        # The group taking a block at a step fills one at the step before.
        g = groups[-step % bs]
        for j in range(steps):
            if g:
                takers += g
                at += [j] * len(g)
            g = groups[-(step + j + 1) % bs]
            if g and caching:
                fills += g
        self.advance(n * steps)
        if not takers:
            if fills:
                self._cache_fills(fills)
            return None, None, None
        delta = np.zeros(steps, dtype=np.int64)
        held = _HeldSeries(self.held(), steps)
        if fills and any(s.hashes is not None and s.indexed < len(s.hashes) for s in fills):
            # A block filled here has its content's key, which a cached block might hold
            # that a take evicts first (or a tier): each step's takes before its fills.
            for j in range(steps):
                self._take(list(groups[-(step + j) % bs]), delta, j, held)
                self.fill_decoders(step + j)
                held.mark(j, self.held())
        else:
            self._take(takers, delta, at, held)
            if fills:
                self._cache_fills(fills)
        counts = np.bincount(at, minlength=steps)
        limits = delta.cumsum()
        self.sum_limit += int(limits[-1])
        self.entries += len(takers)
        return counts.cumsum(), limits, held.columns()

    def _take(self, seqs: list[Seq], delta: np.ndarray, steps: list[int] | int,
              held: _HeldSeries) -> None:
        """A block for each of ``seqs`` (taking blocks in a row hands them out exactly as
        one take of them all), adding to ``delta`` at each one's step what its sequence's
        slots to be written grow by (a whole block, but where its final length ends). The
        blocks evicted go down to the tiers step by step, as steps taken one at a time
        send them (``held`` marks what the tiers hold after each)."""
        if not seqs:
            return
        bs = self.bs
        at = [steps] * len(seqs) if isinstance(steps, int) else steps
        plain = self.pool.num_plain_free
        if self.offload is None or len(seqs) <= plain:
            blocks = self.pool.take(len(seqs))
        else:
            evicted, hits = array("Q"), array("q") if self.ranked else None
            blocks = self.pool.take(len(seqs), evicted, hits)
            # Plain blocks go first: the evicted ones are the last takers', in step order.
            i = plain
            while i < len(seqs):
                j = at[i]
                e = i + 1
                while e < len(seqs) and at[e] == j:
                    e += 1
                self._store(evicted[i - plain : e - plain], blocks[i:e],
                            hits[i - plain : e - plain] if hits is not None else None)
                held.mark(j, self.held())
                i = e
        for seq, block, j in zip(seqs, blocks, at, strict=True):
            table = seq.table
            m = len(table)  # type: ignore[arg-type]
            table.append(block)  # type: ignore[union-attr]
            f = seq.final_len
            delta[j] += bs if f >= (m + 1) * bs else max(f - m * bs, 0)

    # --- hashes --------------------------------------------------------------------------

    def _findable(self, seq: Seq) -> bool:
        """Whether a lookup could find any of ``seq``'s blocks: not for a private prompt
        that never ran (no block can hold it), nor without a prefix cache."""
        return self.caching and not (seq.private and seq.hashes is None)

    def _hashes_upto(self, seq: Seq, num_blocks: int) -> np.ndarray:
        """``seq``'s block keys (uint64), computed (once) for at least its first
        ``num_blocks`` full blocks."""
        hashes = seq.hashes
        have = 0 if hashes is None else len(hashes)
        if hashes is None or have < num_blocks:
            bs = self.bs
            parent = int(hashes[-1]) if have else ROOT_HASH  # type: ignore[index]
            new = np.asarray(self.hasher.chain(parent, seq.token_ids(
                have * bs, num_blocks * bs, self.vocab)), dtype=np.uint64)
            hashes = seq.hashes = new if hashes is None else np.concatenate((hashes, new))
        return hashes


class _HeldSeries:
    """The bytes each tier holds after each of ``steps`` steps taken in one go, from what
    they held before and what they held after the steps that sent blocks down."""

    def __init__(self, before: tuple[int, ...], steps: int) -> None:
        self.before, self.steps = before, steps
        self.at: list[int] = []
        self.values: list[tuple[int, ...]] = []

    def mark(self, step: int, held: tuple[int, ...]) -> None:
        """After ``step`` (in order), the tiers hold ``held``."""
        last = self.values[-1] if self.values else self.before
        if held != last:
            self.at.append(step)
            self.values.append(held)

    def columns(self) -> np.ndarray | None:
        """Tiers by steps, or None when nothing changed."""
        if not self.values:
            return None
        rows = np.asarray([self.before, *self.values], dtype=np.int64)
        where = np.searchsorted(np.asarray(self.at), np.arange(self.steps), side="right")
        return rows[where].T
