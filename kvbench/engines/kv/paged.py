"""Paged KV manager: fixed-size blocks, per-sequence block tables, prefix caching, fork + CoW.

Token position ``p`` of a sequence lives in slot ``table[p // block_size] * block_size +
p % block_size``. Tables only grow at the end, except that copy-on-write swaps a shared,
partially filled last block for a private copy before the sequence writes into it.

Prefix caching indexes every full block, once its KV is written (``commit``), by the chained
hash of all tokens up to its end, so a later sequence with the same leading tokens reuses the
blocks instead of recomputing them. A cached block nobody references stays free but findable
until the pool needs it for something else (``eviction``: LRU, or LFU by prefix hits).

With a sliding-window model and ``sliding_window_release``, blocks that fall wholly outside
the window of every query still to come are freed as the sequence advances (as vLLM's
sliding-window manager does); their table entries stay, stale, for position bookkeeping,
and windowed attention never reads them. Without it they are kept to the end.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal

import numpy as np

from kvbench.engines.base import BatchShape, KVStats, causal_pairs
from kvbench.engines.config import EngineConfig, EngineSettings, KVPolicy, Paging
from kvbench.engines.kv.base import KVManager, steps_within
from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.eviction import EVICTIONS, Eviction
from kvbench.engines.kv.hashing import ROOT_HASH, BlockHasher
from kvbench.engines.kv.offload import OffloadSpec, OffloadTiers, Preemption
from kvbench.engines.kv.oracle import BlockTrace, PrefixOracle
from kvbench.engines.kv.spec import Footprint, KVSpec
from kvbench.engines.sequence import Sequence
from kvbench.engines.sim.costmodel import CostModel
from kvbench.errors import KvbenchError
from kvbench.kernels.layouts import BlockTables
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.workloads.model import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def table_slots(table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """The slots (int64) of token positions ``[start, end)`` of a block table."""
    first = start // block_size
    blocks = np.array(table[first : _cdiv(end, block_size)], dtype=np.int64)
    slots = (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)).ravel()
    return slots[start - first * block_size : end - first * block_size]


def paged_footprint(request: Request, block_size: int, num_blocks: int) -> Footprint:
    """One sample's blocks at its longest: the least a paged cache of ``num_blocks`` blocks
    must hold for ``request`` to run (further samples can wait or be preempted)."""
    blocks = _cdiv(request.prompt_tokens + request.output_tokens, block_size)
    return Footprint(
        tokens=blocks * block_size, capacity_tokens=num_blocks * block_size,
        what=f"{blocks} blocks of {block_size} tokens for one sample",
        capacity=f"{num_blocks} blocks",
    )


class PagedPolicy(Paging, KVPolicy):
    """Fixed-size blocks with per-sequence block tables; prefix caching (``eviction`` of
    cached free blocks: ``lru`` or ``lfu``) and fork + CoW. ``offload`` keeps evicted cached
    blocks in tiers below device memory (:mod:`~kvbench.engines.kv.offload`; the run's
    ``kv_offload`` unless set); with them, ``preemption = "swap"`` copies a preempted
    sequence's KV to the first tier instead of recomputing it (the run's ``kv_preemption``
    unless set). ``leak_finished`` is a deliberate fault: finished sequences' blocks are
    never returned."""

    kind: Literal["paged"] = "paged"
    summary = "fixed-size blocks + block tables, prefix caching (LRU | LFU), fork + copy-on-write"
    leak_finished: bool = False
    eviction: Eviction = "lru"
    sliding_window_release: bool = False
    offload: OffloadSpec | None = None
    preemption: Preemption | None = None

    def resolved(self, settings: EngineSettings) -> PagedPolicy:
        out = super().resolved(settings)
        if out.offload is None and settings.offload is not None:
            out = out.model_copy(update={"offload": settings.offload})
        if out.preemption is None and settings.preemption is not None:
            out = out.model_copy(update={"preemption": settings.preemption})
        return out

    def label(self) -> str:
        base = f"paged/bs{self.block_size}" if self.block_size else "paged"
        return base + ("/lfu" if self.eviction == "lfu" else "") + (
            "/swa-release" if self.sliding_window_release else "") + (
            f"/offload:{self.offload.label()}" if self.offload else "") + (
            "/swap" if self.preemption == "swap" else "")

    def check(self, config: EngineConfig) -> list[str]:
        if self.preemption == "swap" and (self.offload is None or self.sliding_window_release):
            raise KvbenchError(
                "preemption = \"swap\" copies a preempted sequence's KV to the first offload "
                "tier: give it one (--kv-offload cpu:SIZE), and keep every block it holds "
                "(no sliding_window_release)")
        if self.offload is not None:
            if config.device.kind != "sim":
                _check_real_offload(self.offload)
            if not config.prefix_caching:
                raise KvbenchError(
                    "KV offload tiers keep the prefix cache's evicted blocks: drop "
                    "--no-prefix-caching (or the offload)")
        if self.sliding_window_release and config.preset.sliding_window is None:
            raise KvbenchError(
                f"sliding_window_release needs a sliding-window model; {config.preset.name} "
                "attends to its whole context (try mistral-7b-v0.1)"
            )
        return []

    def footprint(self, config: EngineConfig, request: Request) -> Footprint:
        return paged_footprint(request, config.kv.page_tokens, config.num_pages)

    def manager(self, config: EngineConfig) -> PagedKVManager:
        return PagedKVManager(
            config.num_pages, config.kv.page_tokens, config.kv.bytes_per_token,
            config.scheduler.max_model_len, enable_prefix_caching=config.prefix_caching,
            leak_finished=self.leak_finished, dtype=config.kv.dtype, eviction=self.eviction,
            sliding_window=config.preset.sliding_window if self.sliding_window_release else None,
            offload=offload_tiers(self.offload, config) if self.offload else None,
            swap=self.preemption == "swap",
        )


def _check_real_offload(spec: OffloadSpec) -> None:
    """Real compute copies real KV to one tier in host memory, before the step."""
    kinds = [t.kind for t in spec.tiers]
    if kinds != ["cpu"]:
        raise KvbenchError(
            f"KV offload tiers {spec.label()} on real compute: it keeps one cpu tier in host "
            "memory (e.g. cpu:64MiB); cxl and disk tiers are simulated only "
            "(--device sim:GPU)")
    if spec.overlap != "none":
        raise KvbenchError(
            "KV offload overlap = \"layerwise\" is priced on simulated devices only; real "
            "compute copies the blocks before the step (overlap = \"none\")")


def offload_tiers(spec: OffloadSpec, config: EngineConfig) -> OffloadTiers:
    """``spec``'s tiers under ``config``'s pool, a block's recomputation priced on its
    simulated device: the FLOPs of its tokens at their depth, attention included."""
    cost = CostModel(config.preset, config.device.hardware, config.device.tp)
    assert cost.coef is not None
    rate = cost.hardware.flops_per_s * cost.coef.flops_efficiency
    bs = config.kv.page_tokens

    @functools.cache
    def recompute_s(depth: int) -> float:
        shape = BatchShape(prefill_tokens=bs, context_tokens=(depth + 1) * bs,
                           attn_pairs=causal_pairs(depth * bs, bs))
        return cost.terms(shape).flops / rate

    gpu = config.device.gpu.name if config.device.gpu is not None else None
    # On real compute one admission loads at most a whole context's blocks at once.
    in_flight = None if config.device.kind == "sim" else \
        -(-config.scheduler.max_model_len // bs)
    return OffloadTiers(spec, bs, bs * config.kv.bytes_per_token, gpu, recompute_s,
                        ranks=config.device.tp, host_in_flight=in_flight)


class _TierSeries:
    """Bytes each offload tier holds after each of ``steps`` decode steps taken in one go
    (blocks evicted to grow sequences go down): ``offload:<kind>`` columns."""

    def __init__(self, offload: OffloadTiers | None, steps: int) -> None:
        self.tiers = offload.tiers if offload is not None else []
        self.held = np.empty((len(self.tiers), steps), dtype=np.int64)
        self._last = [len(t) for t in self.tiers]
        self._since = 0

    def mark(self, step: int) -> None:
        """Step ``step``'s events are done: the steps before it held the last counts."""
        if self.tiers:
            self.held[:, self._since : step] = np.array(self._last)[:, None]
            self._last, self._since = [len(t) for t in self.tiers], step

    def columns(self) -> dict[str, np.ndarray]:
        if not self.tiers:
            return {}
        self.held[:, self._since :] = np.array(self._last)[:, None]
        return {f"offload:{t.kind}": self.held[i] * t.block_bytes
                for i, t in enumerate(self.tiers)}


@dataclass(slots=True)
class _SeqBlocks:
    """A live sequence's blocks: ``table[i]`` holds token positions ``[i*bs, (i+1)*bs)``."""

    table: list[int]
    num_committed: int  # leading tokens whose KV is written (as of the last commit)
    num_indexed: int  # leading blocks already offered to the prefix cache
    final_len: int  # tokens whose KV it writes by the end (the last sampled one gets none)
    released: int = 0  # leading blocks freed outside the sliding window (entries kept stale)


class PagedKVManager(KVManager):
    """Paged KV bookkeeping over ``num_blocks`` blocks of ``block_size`` token slots.

    ``leak_finished`` is a deliberate fault for testing leak detection: finished sequences'
    blocks are never returned (preempted ones still are).
    """

    kind = "paged"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_token: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        leak_finished: bool = False,
        dtype: str | None = None,
        eviction: Eviction = "lru",
        sliding_window: int | None = None,
        offload: OffloadTiers | None = None,
        swap: bool = False,
    ) -> None:
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("bytes_per_token", bytes_per_token),
            ("max_model_len", max_model_len),
        ):
            if value <= 0:
                raise KvbenchError(f"paged KV cache: {name} must be positive, got {value}")
        if eviction not in EVICTIONS:
            raise KvbenchError(f"unknown eviction {eviction!r}: use one of {', '.join(EVICTIONS)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spec = KVSpec(block_size, bytes_per_token, dtype)
        self.max_model_len = max_model_len
        self.capacity_tokens = num_blocks * block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.leak_finished = leak_finished
        self.releases_finished = not leak_finished
        self.eviction = eviction
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, block_size, eviction)
        if offload is not None and not enable_prefix_caching:
            raise KvbenchError("KV offload tiers keep the prefix cache's blocks: enable it")
        self.offload = offload
        if offload is not None:
            self.pool.on_evict = offload.store
            self.load_layerwise = offload.spec.overlap == "layerwise"
        if swap and (offload is None or sliding_window is not None):
            raise KvbenchError(
                "swap preemption keeps preempted KV in an offload tier, and needs every "
                "block of a sequence held (no sliding-window release)")
        self.swaps = swap
        self._hasher = BlockHasher(block_size)
        # What the prefix cache looked up and made findable, for prefix_oracle.
        self.trace = BlockTrace()
        self._seqs: dict[int, _SeqBlocks] = {}
        # Kept across preemption (the tokens do not change), dropped when a sequence finishes.
        self._hashes: dict[int, list[int]] = {}
        self._copies: list[SlotCopy] = []
        # Running sums over live sequences for reserved_ahead_bytes (stats() reads it every
        # step): slots each will write by its end (table room, capped at its final length)
        # and slots written. Sequences that took part in a fork may share a partial block
        # and are corrected one by one.
        self._sum_limit = 0
        self._sum_committed = 0
        self._forked: set[int] = set()
        self._used_tokens = 0
        self._table_entries = 0
        self._copied_bytes = 0
        self._hit_tokens = 0
        self._query_tokens = 0

    def footprint(self, request: Request) -> Footprint:
        return paged_footprint(request, self.block_size, self.num_blocks)

    def held_tokens(self, prompt: int, output: int, n: int = 1) -> int:
        # Samples share the prompt's blocks.
        return _cdiv(prompt + n * output, self.block_size) * self.block_size

    def lookup_prefix(self, seq: Sequence) -> int:
        if self._is_swapped(seq):
            return seq.num_computed_tokens  # resumes where it stopped
        if not self.enable_prefix_caching:
            return 0
        hashes = self._hashes_upto(seq, seq.num_tokens // self.block_size)
        # At least one token must be left to compute: its logits give the next token.
        limit = (seq.num_tokens - 1) // self.block_size
        return self._found(hashes, limit) * self.block_size

    def cached_prefix_tokens(self, prompt_ids: np.ndarray) -> int:
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        limit = (len(prompt_ids) - 1) // bs
        hashes = self._hasher.chain(ROOT_HASH, prompt_ids[: limit * bs])
        return self._found(hashes, limit) * bs

    def allocate(self, seq: Sequence, num_cached: int, num_new: int) -> bool:
        if seq.seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq.seq_id} is already allocated")
        if self._is_swapped(seq):
            return self._swap_in(seq, num_new)
        bs = self.block_size
        hits: list[int] = []
        want = num_cached // bs
        if num_cached:
            if not self.enable_prefix_caching or num_cached % bs:
                raise RuntimeError(f"cannot attach {num_cached} cached tokens (block size {bs})")
            hits, below = self._attachable(seq, want)
            if below is None:
                raise RuntimeError("prefix lookup is stale: cached blocks were evicted since")
        num_fresh = _cdiv(num_cached + num_new, bs) - len(hits)
        if num_fresh + self.pool.count_free(hits) > self.pool.num_free:
            return False
        self._used_tokens += self.pool.touch(hits) * bs
        # Blocks found below device memory move up into fresh blocks.
        below = self._hashes[seq.seq_id][len(hits) : want] if want > len(hits) else []
        loaded = self.offload.load(below, len(hits)) if self.offload is not None and below \
            else None
        table = hits + self.pool.take(num_fresh)
        if loaded is not None:
            self._attach_loaded(seq, table, len(hits), want, loaded)
        self._hold(seq.seq_id, _SeqBlocks(table, num_cached, want, seq.max_tokens - 1))
        if self.enable_prefix_caching:
            self._hit_tokens += num_cached
            self._query_tokens += seq.num_tokens
            limit = (seq.num_tokens - 1) // bs
            self.trace.lookup(self._hashes_upto(seq, limit)[:limit])
            # Loaded blocks are findable in device memory again, as if written.
            self.trace.write(below)
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        return True

    def _is_swapped(self, seq: Sequence) -> bool:
        return self.swaps and self.offload.swapped(seq.seq_id)  # type: ignore[union-attr]

    def swap_out(self, seq: Sequence) -> bool:
        """Preempt ``seq`` by copying the blocks of its computed KV to the first offload
        tier and freeing them; False, changing nothing, where it is to be recomputed
        instead (no swap preemption, nothing computed, or no room left in the tier)."""
        if not self.swaps:
            return False
        assert self.offload is not None
        state = self._seqs[seq.seq_id]
        blocks = state.table[: _cdiv(state.num_committed, self.block_size)]
        if not blocks or not self.offload.swap_out(seq.seq_id, blocks):
            return False
        self.free(seq)
        return True

    def _swap_in_need(self, seq: Sequence, num_new: int) -> tuple[list[int], int]:
        """The device blocks still caching swapped ``seq``'s leading full blocks, and the
        fresh blocks it takes besides to resume with room for ``num_new`` more tokens."""
        bs, committed = self.block_size, seq.num_computed_tokens
        full = committed // bs
        hits = self.pool.lookup(islice(self._hashes_upto(seq, full), full))
        return hits, _cdiv(committed + num_new, bs) - len(hits)

    def _swap_in(self, seq: Sequence, num_new: int) -> bool:
        """Resume swapped ``seq``: its blocks still cached on the device attached, the rest
        copied back from the tier into fresh blocks, its computed KV as it was."""
        assert self.offload is not None
        hits, num_fresh = self._swap_in_need(seq, num_new)
        pool, bs, committed = self.pool, self.block_size, seq.num_computed_tokens
        if num_fresh + pool.count_free(hits) > pool.num_free:
            return False
        self._used_tokens += pool.touch(hits) * bs + committed - len(hits) * bs
        table = hits + pool.take(num_fresh)
        self.offload.swap_in(seq.seq_id, table[len(hits) : _cdiv(committed, bs)])
        state = _SeqBlocks(table, committed, len(hits), seq.max_tokens - 1)
        self._hold(seq.seq_id, state)
        # Blocks copied back are findable again (superseding copies below).
        self._index(seq, state, committed // bs)
        return True

    def _hold(self, seq_id: int, state: _SeqBlocks) -> None:
        """``state`` becomes ``seq_id``'s blocks, counted in the running sums."""
        self._seqs[seq_id] = state
        self._table_entries += len(state.table) - state.released
        self._sum_limit += self._limit(state)
        self._sum_committed += state.num_committed

    def _found(self, hashes: list[int], limit: int) -> int:
        """Leading blocks of ``hashes[:limit]`` cached in device memory or below it."""
        n = len(self.pool.lookup(islice(hashes, limit)))
        if self.offload is not None and n < limit:
            n += self.offload.run(hashes[n:limit])
        return n

    def _attachable(self, seq: Sequence, want: int) -> tuple[list[int], int | None]:
        """The device blocks caching ``seq``'s first ``want`` blocks, and how many more of
        them the tiers below hold (None: not all of them are cached any more)."""
        hashes = self._hashes_upto(seq, want)
        hits = self.pool.lookup(islice(hashes, want))
        below = want - len(hits)
        if below and (self.offload is None
                      or self.offload.run(hashes[len(hits) : want]) < below):
            return hits, None
        return hits, below

    def _attach_loaded(self, seq: Sequence, table: list[int], start: int, end: int,
                       hits: list[int]) -> None:
        """Fresh ``table[start:end]`` received blocks loaded from below: findable again, with
        the hits their content served (this one included), and copied there if real."""
        assert self.offload is not None
        if self.offload.host is not None:
            self.offload.host.place(table[start:end])
        hashes = self._hashes[seq.seq_id]
        self.pool.cache(table, hashes, start, end)
        self.offload.note_depths(hashes, start, end)
        self.pool.set_hits(table[start:end], [h + 1 for h in hits])
        self._used_tokens += (end - start) * self.block_size

    def grow(self, seq: Sequence, num_new: int) -> bool:
        state = self._seqs[seq.seq_id]
        table, bs = state.table, self.block_size
        pos = seq.num_computed_tokens
        # Only the block holding `pos` can be both shared and written to: shared blocks hold
        # already-computed tokens, so they all end at or before it.
        last = pos // bs
        num_blocks = len(table)
        cow = num_new > 0 and last < num_blocks and self.pool.ref[table[last]] > 1
        num_fresh = (pos + num_new + bs - 1) // bs - num_blocks
        if num_fresh <= 0 and not cow:
            return True  # the common decode step: room left in the last block
        num_fresh = max(num_fresh, 0)
        if num_fresh + cow > self.pool.num_free:
            return False
        if cow:
            old = table[last]
            new = self.pool.copy_on_write(old)
            table[last] = new
            self._used_tokens += pos - last * bs
            self._copies.append(SlotCopy(src=old * bs, dst=new * bs, num_slots=bs))
            self._copied_bytes += bs * self.bytes_per_token
        if num_fresh:
            limit = self._limit(state)
            table += self.pool.take(num_fresh)
            self._table_entries += num_fresh
            self._sum_limit += self._limit(state) - limit
        return True

    def commit(self, seq: Sequence) -> None:
        state = self._seqs[seq.seq_id]
        n = seq.num_computed_tokens
        committed = state.num_committed
        if not committed <= n <= len(state.table) * self.block_size:
            raise RuntimeError(
                f"sequence {seq.seq_id}: {n} computed tokens outside its blocks "
                f"(committed {committed}, room {len(state.table) * self.block_size})"
            )
        self._used_tokens += n - committed
        self._sum_committed += n - committed
        state.num_committed = n
        if self.enable_prefix_caching:
            self._index(seq, state, n // self.block_size)
        if self.sliding_window is not None:
            self._release_outside_window(state, n)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks. A sequence holding none (never admitted) is a no-op."""
        finished = seq.is_finished
        if finished:
            self._hashes.pop(seq.seq_id, None)
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            return
        if not finished and state.num_indexed:
            # Preempted: its blocks stay findable for its return (the oracle's view of it).
            self.trace.write(self._hashes[seq.seq_id][: state.num_indexed])
        self._sum_limit -= self._limit(state)
        self._sum_committed -= state.num_committed
        self._forked.discard(seq.seq_id)
        table, filled = state.table, state.num_committed
        if state.released:
            table, filled = table[state.released :], filled - state.released * self.block_size
        self._table_entries -= len(table)
        if finished and self.leak_finished:
            self._used_tokens -= self.pool.leak(table, filled)
        else:
            self._used_tokens -= self.pool.release(table, filled)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self._seqs:
            raise RuntimeError(f"sequence {child.seq_id} is already allocated")
        state = self._seqs[parent.seq_id]
        # Share only blocks holding computed KV; any room reserved beyond stays the parent's.
        shared = state.table[: _cdiv(state.num_committed, self.block_size)]
        self.pool.share(shared[state.released :])
        self._hold(child.seq_id, _SeqBlocks(
            shared, state.num_committed, min(state.num_indexed, len(shared)), state.final_len,
            state.released,
        ))
        self._forked.update((parent.seq_id, child.seq_id))
        hashes = self._hashes.get(parent.seq_id)
        if hashes is not None:
            self._hashes[child.seq_id] = list(hashes)

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        state, bs = self._seqs[seq.seq_id], self.block_size
        table = state.table
        if not state.released * bs <= start <= end <= len(table) * bs:
            raise RuntimeError(
                f"sequence {seq.seq_id}: positions [{start}, {end}) outside its {len(table)} blocks"
            )
        return table_slots(table, bs, start, end)

    def block_table(self, seq: Sequence) -> list[int]:
        """A copy of ``seq``'s block table (entries released outside the window included)."""
        return list(self._seqs[seq.seq_id].table)

    def block_refs(self, blocks: list[int]) -> list[int]:
        """How many live sequences hold each of ``blocks``."""
        return list(map(self.pool.ref.__getitem__, blocks))

    def held_blocks(self, seq: Sequence) -> list[int]:
        """The blocks ``seq`` holds: its table past the entries released outside the window."""
        state = self._seqs[seq.seq_id]
        return state.table[state.released :]

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> BlockTables:
        bs = self.block_size
        tables = np.zeros((len(seqs), int(-(-context_lens.max() // bs))), dtype=np.int32)
        for i, seq in enumerate(seqs):
            n = -(-int(context_lens[i]) // bs)
            tables[i, :n] = self._seqs[seq.seq_id].table[:n]
        return BlockTables(tables, bs)

    def take_copies(self) -> list[SlotCopy]:
        copies, self._copies = self._copies, []
        return copies

    def stats(self) -> KVStats:
        """Bytes count whole blocks except ``used_bytes``, the token slots holding written KV
        in blocks some live sequence references (each block once), and
        ``reserved_ahead_bytes``, the slots of their blocks live sequences will still write."""
        pool, bpt = self.pool, self.bytes_per_token
        block_bytes = self.block_size * bpt
        free = pool.num_free * block_bytes
        caching = self.enable_prefix_caching
        return KVStats(
            capacity_bytes=self.num_blocks * block_bytes,
            used_bytes=self._used_tokens * bpt,
            reserved_bytes=(self.num_blocks - pool.num_free) * block_bytes,
            reserved_ahead_bytes=self._ahead_tokens() * bpt,
            free_bytes=free,
            # Any free block serves any request: paged memory has no external fragmentation.
            largest_free_bytes=free,
            shared_bytes=pool.num_shared * block_bytes,
            prefix_hit_tokens=self._hit_tokens if caching else None,
            prefix_query_tokens=self._query_tokens if caching else None,
            block_allocs=pool.num_allocs,
            block_frees=pool.num_frees,
            copied_bytes=self._copied_bytes,
            page_table_entries=self._table_entries,
            evictions=pool.num_evictions if caching else None,
            **(self.offload.kv_fields() if self.offload is not None else {}),
        )

    def take_load_s(self) -> float:
        return self.offload.take_load_s() if self.offload is not None else 0.0

    def trace_prefix_accesses(self, on: bool) -> None:
        if not on:
            self.trace.stop()

    def prefix_oracle(self) -> PrefixOracle | None:
        if not self.enable_prefix_caching:
            return None
        tiers = [] if self.offload is None else [
            (t.kind, t.capacity_blocks) for t in self.offload.tiers]
        return self.trace.oracle(self.num_blocks, self.block_size, tiers)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes_per_token": self.bytes_per_token,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": self.enable_prefix_caching,
            "eviction": self.eviction,
            "sliding_window_release": self.sliding_window,
            "leak_finished": self.leak_finished,
            "offload": self.offload.describe() if self.offload is not None else None,
            "preemption": "swap" if self.swaps else "recompute",
        }

    def _release_outside_window(self, state: _SeqBlocks, num_computed: int) -> None:
        """Free the leading blocks no query from ``num_computed`` on can see: query ``q``
        reads positions ``q - window + 1 .. q``."""
        assert self.sliding_window is not None
        outside = max(num_computed - self.sliding_window + 1, 0) // self.block_size
        if outside > state.released:
            blocks = state.table[state.released : outside]
            self._used_tokens -= self.pool.release(blocks, len(blocks) * self.block_size)
            self._table_entries -= len(blocks)
            state.released = outside

    # --- decode fast-forward ---------------------------------------------------------------

    def fast_forward_blocker(self) -> str | None:
        if self.sliding_window is not None:
            return "blocks outside the sliding window are released as sequences advance"
        return super().fast_forward_blocker()

    def decode_room(self, seqs: list[Sequence], max_steps: int, keep_cached: bool = False) -> int:
        """Steps before a grow could fail or copy: every block the sequences reach at a block
        boundary comes from the free queues, so at most ``num_free`` of them; a shared block
        being written (copy-on-write) or a window release is an event of its own. While a
        request waits refused at the head of the queue (``keep_cached``), only plain blocks
        count: evicting a cached one could change what that request hits."""
        if self.sliding_window is not None or self._copies:
            return 0
        bs, ref, caching = self.block_size, self.pool.ref, self.enable_prefix_caching
        firsts = []
        for seq in seqs:
            state = self._seqs[seq.seq_id]
            p, table = seq.num_computed_tokens, state.table
            last = p // bs
            if state.num_committed != p or p > len(table) * bs:
                return 0
            if last < len(table) and ref[table[last]] > 1:
                return 0
            if caching and state.num_indexed != last:
                return 0
            firsts.append(len(table) * bs - p)
        room = self.pool.num_plain_free if keep_cached else self.pool.num_free
        return steps_within(firsts, bs, max_steps, room)

    def _decode_events(self, seqs: list[Sequence], steps: int
                       ) -> tuple[dict[int, list[int]], dict[int, list[int]], np.ndarray]:
        """Per step of the next ``steps`` decode steps: the sequences (by index) that reach a
        block boundary and take a block, those that fill a block (made findable by its hash
        with prefix caching), and the growth of the running sum of slots to be written."""
        bs, caching = self.block_size, self.enable_prefix_caching
        takes: dict[int, list[int]] = {}
        fills: dict[int, list[int]] = {}
        limit_delta = np.zeros(steps, dtype=np.int64)
        for i, seq in enumerate(seqs):
            state = self._seqs[seq.seq_id]
            p, f = seq.num_computed_tokens, state.final_len
            m = len(state.table)
            j = m * bs - p
            while j < steps:
                takes.setdefault(j, []).append(i)
                limit_delta[j] += min((m + 1) * bs, f) - min(m * bs, f)
                m += 1
                j += bs
            if caching:
                j = (-(p + 1)) % bs
                while j < steps:
                    fills.setdefault(j, []).append(i)
                    j += bs
        return takes, fills, limit_delta

    def decode_stop(self, seqs: list[Sequence], steps: int, avoid: set[int]) -> int:
        if not self.enable_prefix_caching or not avoid:
            return steps
        bs = self.block_size
        _, fills, _ = self._decode_events(seqs, steps)
        hashes: dict[int, list[int]] = {}
        for j in sorted(fills):
            for i in fills[j]:
                seq = seqs[i]
                full = (seq.num_computed_tokens + j + 1) // bs
                chain = hashes.get(i)
                if chain is None:
                    chain = hashes[i] = self._hashes_upto(
                        seq, (seq.num_computed_tokens + steps) // bs)
                if chain[full - 1] in avoid:
                    return j
        return steps

    def advance_decode(self, seqs: list[Sequence], steps: int) -> dict[str, np.ndarray]:
        bs, pool = self.block_size, self.pool
        n = len(seqs)
        states = [self._seqs[s.seq_id] for s in seqs]
        starts = [s.num_computed_tokens for s in seqs]
        takes, fills, limit_delta = self._decode_events(seqs, steps)
        tiers = _TierSeries(self.offload, steps)
        # In step order: a step's grows (in running order), then its commits.
        for j in sorted(takes.keys() | fills.keys()):
            idx = takes.get(j)
            if idx:
                for i, block in zip(idx, pool.take(len(idx)), strict=True):
                    states[i].table.append(block)
            idx = fills.get(j)
            if idx:
                for i in idx:
                    self._index(seqs[i], states[i], (starts[i] + j + 1) // bs)
            tiers.mark(j)
        count = np.zeros(steps, dtype=np.int64)
        for j, idx in takes.items():
            count[j] = len(idx)
        taken = np.cumsum(count)
        grown = int(taken[-1])
        written = n * np.arange(1, steps + 1, dtype=np.int64)
        bpt, block_bytes = self.bytes_per_token, self.block_size * self.bytes_per_token
        free = (pool.num_free + grown - taken) * block_bytes
        limits = self._sum_limit + np.cumsum(limit_delta)
        columns = {
            "used_bytes": (self._used_tokens + written) * bpt,
            "reserved_bytes": self.num_blocks * block_bytes - free,
            "reserved_ahead_bytes": (limits - (self._sum_committed + written)) * bpt,
            "free_bytes": free,
            "largest_free_bytes": free,
            "block_allocs": pool.num_allocs - grown + taken,
            "page_table_entries": self._table_entries + taken,
            **tiers.columns(),
        }
        self._used_tokens += n * steps
        self._sum_committed += n * steps
        self._sum_limit = int(limits[-1])
        self._table_entries += grown
        for i, state in enumerate(states):
            state.num_committed = starts[i] + steps
        return columns

    def would_admit(self, seq: Sequence, num_cached: int, num_new: int) -> bool | None:
        if seq.seq_id in self._seqs:
            return None
        bs, pool = self.block_size, self.pool
        if self._is_swapped(seq):
            found, fresh = self._swap_in_need(seq, num_new)
            return fresh + pool.count_free(found) <= pool.num_free
        hits: list[int] = []
        if num_cached:
            if not self.enable_prefix_caching or num_cached % bs:
                return None
            hits, below = self._attachable(seq, num_cached // bs)
            if below is None:
                return None
        num_fresh = _cdiv(num_cached + num_new, bs) - len(hits)
        return num_fresh + pool.count_free(hits) <= pool.num_free

    def waiting_hashes(self, seq: Sequence) -> set[int] | None:
        if not self.enable_prefix_caching:
            return None
        return set(self._hashes_upto(seq, seq.num_tokens // self.block_size))

    def _limit(self, state: _SeqBlocks) -> int:
        """Slots of ``state``'s blocks its sequence writes by its end."""
        return min(len(state.table) * self.block_size, state.final_len)

    def _ahead_tokens(self) -> int:
        """Slots live sequences' blocks hold for tokens still to be written: each one's
        limit minus what it has written (never negative: both stay within its table and
        final length)."""
        total = self._sum_limit - self._sum_committed
        bs, ref, seqs = self.block_size, self.pool.ref, self._seqs
        for seq_id in self._forked:
            state = seqs[seq_id]
            start = state.num_committed
            # A shared partial block is never written in place by a sharer that copies it
            # first; counting it for each sharer would count its free slots twice.
            if start % bs and ref[state.table[start // bs]] > 1:
                total -= min(bs - start % bs, self._limit(state) - start)
        return total

    def _index(self, seq: Sequence, state: _SeqBlocks, full: int) -> None:
        """Make ``seq``'s first ``full`` blocks findable in the prefix cache."""
        if full > state.num_indexed:
            hashes = self._hashes_upto(seq, full)
            if self.offload is not None:
                # Computed again here: a copy held below is superseded.
                self.offload.discard(hashes[state.num_indexed : full])
                self.offload.note_depths(hashes, state.num_indexed, full)
            self.pool.cache(state.table, hashes, state.num_indexed, full)
            self.trace.write(hashes[state.num_indexed : full])
            state.num_indexed = full

    def _hashes_upto(self, seq: Sequence, num_blocks: int) -> list[int]:
        """``seq``'s chained block hashes, computed (once) at least for its first
        ``num_blocks`` full blocks."""
        hashes = self._hashes.get(seq.seq_id)
        if hashes is None:
            hashes = self._hashes[seq.seq_id] = []
        have = len(hashes)
        if have < num_blocks:
            bs = self.block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            start, end, n_prompt = have * bs, num_blocks * bs, seq.num_prompt_tokens
            # Generated blocks (a decode's newly full block) hash from the list as it is.
            ids = (
                seq.output_ids[start - n_prompt : end - n_prompt]
                if start >= n_prompt
                else seq.token_ids(start, end)
            )
            hashes += self._hasher.chain(parent, ids)
        return hashes
