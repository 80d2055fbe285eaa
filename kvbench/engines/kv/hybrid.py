"""KV per layer group, for models whose layers keep different kinds of KV (interleaved
sliding-window and global attention, recurrent state beside attention). Every layout runs on
simulated devices; real compute runs full and sliding-window groups in one pool of equal
blocks (common-page, uniform), laid out as vLLM lays it: ``G`` cache tensors, each shared
by one layer of every group, each group indexing them through its own block tables.

The groups come from :mod:`~kvbench.engines.kv.group_layout`:

- ``common-page`` is vLLM's hybrid allocator: one pool of equal blocks, each group (``G``
  layers of one kind, padding included) taking a block per page position;
- ``per-group`` gives each layer group a pool of its own page size, the pools carving one
  budget's large pages (Jenga: :mod:`~kvbench.engines.kv.large_pages`);
- ``uniform`` keeps every token in every attention layer, windows included (vLLM without
  its hybrid manager), in one pool.

Every attention group pages its tokens in blocks of ``B`` tokens; a sliding-window group
frees the blocks its window has left, which stay findable in the prefix cache until evicted.
A recurrent-state group holds one block per running sequence and, with prefix caching,
keeps a snapshot of the state at the last snapshot boundary each step passes (the scan
hands out its state there), cached like any block. The boundaries are common-page's blocks
under either layout, so that both keep state at the same points.

A prefix hit is a number of whole blocks every group can serve: a full group its leading
blocks, a window group the blocks under its window at that point, a state group a snapshot
at that boundary. The request's hit is the longest length all groups serve, which is how
hybrid models lose prefix hits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from kvbench.engines.base import KVStats
from kvbench.engines.config import EngineConfig, KVPolicy, Paging
from kvbench.engines.kv.base import KVManager
from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.eviction import Eviction
from kvbench.engines.kv.group_layout import GroupLayout, group_layout
from kvbench.engines.kv.hashing import ROOT_HASH, BlockHasher
from kvbench.engines.kv.large_pages import LargePages, OnePool
from kvbench.engines.kv.paged import table_slots
from kvbench.engines.kv.spec import Footprint, KVSpec, LayerPools, kv_bytes_per_token
from kvbench.engines.sequence import Sequence
from kvbench.errors import KvbenchError
from kvbench.kernels.layouts import BlockTables
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.workloads.model import Request

_MASK = (1 << 64) - 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HybridPolicy(Paging, KVPolicy):
    """KV per layer group (``layout``: ``common-page``, ``per-group`` or ``uniform``),
    sliding-window release, state slots and prefix caching per group."""

    kind: Literal["hybrid"] = "hybrid"
    summary = ("KV per layer group: vLLM's common page size or per-group pools, window "
               "release, state slots, prefix hits per group")
    allocates_groups: ClassVar[bool] = True
    layout: Literal["common-page", "per-group", "uniform"] = "common-page"
    eviction: Eviction = "lru"

    def label(self) -> str:
        bs = f"/bs{self.block_size}" if self.block_size else ""
        return f"hybrid/{self.layout}{bs}" + ("/lfu" if self.eviction == "lfu" else "")

    def check(self, config: EngineConfig) -> list[str]:
        groups = config.preset.layer_groups
        if config.device.kind != "sim":
            kinds = sorted({g.kind for g in groups} - {"full", "sliding"})
            if kinds or self.layout == "per-group":
                what = f"{' and '.join(kinds)} layers" if kinds else "per-group pools"
                raise KvbenchError(
                    f"the hybrid KV policy computes full and sliding-window attention under "
                    f"common-page or uniform pools; {what} are simulated only: use --device "
                    "sim:GPU")
        if any(g.kind == "chunked" for g in groups):
            raise KvbenchError(f"{config.preset.name} has chunked local attention, which the "
                               "hybrid policy does not simulate; plan it with kvbench capacity")
        if len({g.window for g in groups if g.kind == "sliding"}) > 1:
            raise KvbenchError(f"{config.preset.name} has sliding windows of several sizes; "
                               "the cost model prices one")
        self.plan(config)
        return []

    def plan(self, config: EngineConfig) -> GroupPlan:
        return GroupPlan.build(config, self.layout)

    def footprint(self, config: EngineConfig, request: Request) -> Footprint:
        return self.plan(config).footprint(request, config.scheduler.max_num_batched_tokens)

    def admission(self, config: EngineConfig):  # type: ignore[no-untyped-def]
        plain = super().admission(config)

        def rejection(request: Request) -> str | None:
            if request.n > 1:
                return (f"request {request.id} has n={request.n} samples; the hybrid KV "
                        "policy runs one sample per request")
            return plain(request)

        return rejection

    def manager(self, config: EngineConfig) -> HybridKVManager:
        sched = config.scheduler
        return HybridKVManager(self.plan(config), sched.max_model_len,
                               sched.max_num_batched_tokens, config.prefix_caching,
                               self.eviction, config.kv.dtype)


@dataclass(frozen=True, slots=True)
class AllocGroup:
    """One allocation group: ``layers`` real layers of ``kind`` in ``block_bytes`` blocks
    (all tensor-parallel ranks, padding included) drawn from pool ``pool``; attention
    blocks hold ``B`` tokens. ``token_bytes`` and ``state_bytes`` are what its real layers
    need per token and per sequence (the rest of a block is padding)."""

    name: str
    kind: str
    layers: int
    window: int
    pool: int
    block_bytes: int
    token_bytes: int
    state_bytes: int

    @property
    def holds_tokens(self) -> bool:
        return self.kind != "state"


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """A model's allocation groups under one of the layouts, within ``budget`` bytes."""

    layout: GroupLayout
    groups: tuple[AllocGroup, ...]
    block_tokens: int
    budget: int
    bytes_per_token: int
    # The unit pools draw from the budget: the least common multiple of their block bytes.
    page_bytes: int
    # State is snapshot every this many blocks: common-page's block under either layout,
    # so that both cache state at the same boundaries.
    state_every: int = 1
    # Each layer's allocation group and its tensor among the pool's ``tensors`` (one per
    # layer slot of a common-page group; one per layer under uniform).
    layer_map: tuple[tuple[int, int], ...] = ()
    tensors: int = 0

    @classmethod
    def build(cls, config: EngineConfig, policy: str) -> GroupPlan:
        preset, tp = config.preset, config.device.tp
        layout = group_layout(preset, policy, config.kv.page_tokens, tp)  # type: ignore[arg-type]
        size, b = layout.layers_per_group, preset.dtype_bytes
        groups: list[AllocGroup] = []
        first: list[tuple[int, int]] = []  # per layer group: its first allocation group, size
        for gp in layout.groups:
            g = gp.group
            per = size or gp.tensors
            first.append((len(groups), per))
            for i in range(gp.tensors // per):
                real = min(per, g.layers - i * per)
                groups.append(AllocGroup(
                    f"{g.kind}{len(groups)}", g.kind, real, g.window,
                    0 if size else len(groups), per * gp.page_bytes * tp,
                    real * g.layer_bytes_per_token_per_rank(b, tp) * tp if g.holds_tokens
                    else 0, real * (g.state_bytes // tp) * tp))
        seen = [0] * len(first)
        layer_map = []
        for group in preset.layer_group_of:
            j, (start, per) = seen[group], first[group]
            seen[group] += 1
            layer_map.append((start + j // per, j % per))
        tensors = size
        if policy == "uniform":  # every attention layer alike: one group, one pool
            groups = [AllocGroup("full0", "full", sum(g.layers for g in groups), 0, 0,
                                 sum(g.block_bytes for g in groups),
                                 sum(g.token_bytes for g in groups), 0)]
            layer_map = [(0, i) for i in range(preset.num_layers)]
            tensors = preset.num_layers
        tokens = {gp.page_tokens for gp in layout.groups if gp.group.holds_tokens}
        if len(tokens) > 1:
            raise KvbenchError(f"{preset.name}'s attention groups get pages of "
                               f"{sorted(tokens)} tokens under {policy}; the hybrid policy "
                               "pages every attention group alike")
        block = tokens.pop() if tokens else layout.block_size
        # Pools of several block sizes carve large pages of their least common multiple.
        sizes = {g.pool: g.block_bytes for g in groups}
        page = math.lcm(*sizes.values())
        budget = config.kv_bytes - config.section.held_back_bytes(config.kv_bytes)
        budget -= budget % page
        if budget < len(sizes) * page:
            raise KvbenchError(f"KV budget {budget} bytes holds fewer than {len(sizes)} "
                               f"{policy} pages of {page} bytes (one per pool); raise "
                               "--kv-memory")
        bpt = max(kv_bytes_per_token(preset, tp), 1)
        every = 1
        if any(not g.holds_tokens for g in groups):
            common = group_layout(preset, "common-page", config.kv.page_tokens, tp)
            every = max(common.block_size // block, 1)
        return cls(layout, tuple(groups), block, budget, bpt, page, every, tuple(layer_map),
                   tensors)

    def blocks_at(self, group: AllocGroup, context: int, chunk: int) -> int:
        """Blocks ``group`` holds for one sequence of ``context`` tokens at most, computed
        in chunks of up to ``chunk`` tokens."""
        b = self.block_tokens
        if not group.holds_tokens:
            return 1
        whole = _cdiv(context, b)
        if group.kind == "sliding":
            return min(whole, _cdiv(group.window - 1, b) + 1 + _cdiv(chunk, b))
        return whole

    def footprint(self, request: Request, chunk: int) -> Footprint:
        context = request.prompt_tokens + request.output_tokens
        per_pool: dict[int, int] = {}
        for g in self.groups:
            per_pool[g.pool] = (per_pool.get(g.pool, 0)
                                + self.blocks_at(g, context, chunk) * g.block_bytes)
        need = sum(_cdiv(n, self.page_bytes) for n in per_pool.values()) * self.page_bytes
        bpt = self.bytes_per_token
        return Footprint(_cdiv(need, bpt), self.budget // bpt,
                         f"{need} bytes of {self.layout.label} blocks", f"{self.budget} bytes")


@dataclass(slots=True)
class _Table:
    """A sequence's blocks in one group: attention block ``i`` holds tokens ``[i*B,
    (i+1)*B)`` (entries before ``released`` are gone out of the window); a state group's
    one block is its running state. ``indexed``: blocks (state: boundaries) cached."""

    blocks: list[int]
    released: int = 0
    indexed: int = 0


@dataclass(slots=True)
class _GroupCounts:
    held_blocks: int = 0
    written_tokens: int = 0  # tokens in referenced blocks (state: running sequences)
    hit_tokens: int = 0
    snapshots: int = 0


@dataclass(slots=True)
class _Seq:
    tables: list[_Table]
    committed: int


class HybridKVManager(KVManager):
    """Bookkeeping of a :class:`GroupPlan`'s groups over their pools."""

    kind = "hybrid"

    def __init__(self, plan: GroupPlan, max_model_len: int, chunk_tokens: int,
                 enable_prefix_caching: bool = True, eviction: Eviction = "lru",
                 dtype: str | None = None) -> None:
        self.plan, self.groups = plan, plan.groups
        self.chunk_tokens, self.eviction = chunk_tokens, eviction
        self.block = b = plan.block_tokens
        self.spec = KVSpec(b, plan.bytes_per_token, dtype)
        self.capacity_tokens = plan.budget // plan.bytes_per_token
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        num_pools = max(g.pool for g in self.groups) + 1
        sizes = [next(g.block_bytes for g in self.groups if g.pool == i)
                 for i in range(num_pools)]
        self.pools = [BlockPool(plan.budget // s, b, eviction) for s in sizes]
        self.budget: OnePool | LargePages = (
            OnePool(self.pools[0], sizes[0]) if num_pools == 1
            else LargePages(self.pools, sizes, plan.page_bytes))
        # Each group's keys differ from every other's in a shared pool; the first group's
        # are the plain chained hashes.
        self._salts = [(i * 0xD1B54A32D192ED03) & _MASK for i in range(len(self.groups))]
        self._hasher = BlockHasher(b)
        self._seqs: dict[int, _Seq] = {}
        self._hashes: dict[int, list[int]] = {}
        self._counts = [_GroupCounts() for _ in self.groups]
        self._hit_tokens = self._query_tokens = 0

    def footprint(self, request: Request) -> Footprint:
        return self.plan.footprint(request, self.chunk_tokens)

    def held_tokens(self, prompt: int, output: int, n: int = 1) -> int:
        return _cdiv(prompt + n * output, self.block) * self.block

    # --- prefix hits ----------------------------------------------------------------------

    def _keys(self, gi: int, hashes: list[int], start: int, end: int) -> list[int]:
        salt = self._salts[gi]
        return hashes[start:end] if not salt else [h ^ salt for h in hashes[start:end]]

    def _window_start(self, gi: int, tokens: int) -> int:
        """The first block group ``gi`` still needs once ``tokens`` tokens are computed:
        the query at position ``tokens`` reads keys from ``tokens - window + 1`` on."""
        g = self.groups[gi]
        if g.kind != "sliding":
            return 0
        return max(tokens - g.window + 1, 0) // self.block

    def _serves(self, gi: int, hashes: list[int], limit: int) -> int:
        """The most leading blocks, up to ``limit``, whose KV group ``gi`` holds cached."""
        g, pool = self.groups[gi], self.pools[self.groups[gi].pool]
        if g.kind in ("full", "latent"):
            return len(pool.lookup(self._keys(gi, hashes, 0, limit)))
        found = [b is not None for b in pool.cached(self._keys(gi, hashes, 0, limit))]
        if g.kind == "state":
            every = self.plan.state_every
            return next((j for j in range(limit - limit % every, 0, -every) if found[j - 1]), 0)
        run = 0
        runs = []
        for f in found:
            run = run + 1 if f else 0
            runs.append(run)
        for j in range(limit, 0, -1):
            if runs[j - 1] >= j - self._window_start(gi, j * self.block):
                return j
        return 0

    def _hit(self, hashes: list[int], limit: int) -> tuple[int, list[int]]:
        """The blocks every group serves, and what each serves alone."""
        alone = [self._serves(i, hashes, limit) for i in range(len(self.groups))]
        k = min(alone)
        while True:
            again = min(self._serves(i, hashes, k) for i in range(len(self.groups)))
            if again == k:
                return k, alone
            k = again

    def lookup_prefix(self, seq: Sequence) -> int:
        if not self.enable_prefix_caching:
            return 0
        limit = (seq.num_tokens - 1) // self.block
        return self._hit(self._hashes_upto(seq, limit), limit)[0] * self.block

    # --- allocation ---------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_cached: int, num_new: int) -> bool:
        if seq.seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq.seq_id} is already allocated")
        b = self.block
        k, rest = divmod(num_cached, b)
        if num_cached and (rest or not self.enable_prefix_caching):
            raise RuntimeError(f"cannot attach {num_cached} cached tokens (block size {b})")
        hashes = self._hashes_upto(seq, k) if num_cached else []
        hits, fresh = [], []
        for gi, g in enumerate(self.groups):
            pool = self.pools[g.pool]
            if not g.holds_tokens:
                found = pool.cached(self._keys(gi, hashes, k - 1, k)) if k else []
                fresh.append(1)
            else:
                found = pool.cached(self._keys(gi, hashes, self._window_start(gi, num_cached), k))
                fresh.append(_cdiv(num_cached + num_new, b) - k)
            if None in found:
                raise RuntimeError("prefix lookup is stale: cached blocks were evicted since")
            hits.append(found)
        if not self.budget.room(*self._per_pool(fresh, hits)):
            return False
        if self.enable_prefix_caching:
            limit = (seq.num_tokens - 1) // b
            alone = self._hit(self._hashes_upto(seq, limit), limit)[1]
            for c, n in zip(self._counts, alone, strict=True):
                c.hit_tokens += n * b
            self._hit_tokens += num_cached
            self._query_tokens += seq.num_tokens
        # Every group's hits are referenced before any fresh block is taken: taking one
        # may evict a cached block another group is about to hit.
        revived = [self.budget.touch(g.pool, h) for g, h in zip(self.groups, hits, strict=True)]
        tables = [self._attach(gi, hits[gi], revived[gi], fresh[gi], k)
                  for gi in range(len(self.groups))]
        self._seqs[seq.seq_id] = _Seq(tables, num_cached)
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        return True

    def _per_pool(self, fresh: list[int], hits: list[list[int]]
                  ) -> tuple[list[int], list[list[int]]]:
        """Groups' fresh blocks and hits, summed per pool."""
        needs: list[int] = [0] * len(self.pools)
        found: list[list[int]] = [[] for _ in self.pools]
        for gi, g in enumerate(self.groups):
            needs[g.pool] += fresh[gi]
            if hits:
                found[g.pool] += hits[gi]
        return needs, found

    def _attach(self, gi: int, hits: list[int], revived: int, fresh: int, k: int) -> _Table:
        """Group ``gi``'s table of a sequence admitted with ``k`` cached blocks: its hits
        (``revived`` of them taken from the free queue) and ``fresh`` blocks."""
        g, c = self.groups[gi], self._counts[gi]
        c.held_blocks += revived
        if not g.holds_tokens:
            if hits:  # the snapshot is copied into the running state, and stays cached
                self.budget.release(g.pool, hits, 0)
                c.held_blocks -= 1
            c.held_blocks += 1
            c.written_tokens += 1
            return _Table(self.budget.take(g.pool, 1), indexed=k)
        c.written_tokens += revived * self.block
        first = k - len(hits)
        c.held_blocks += fresh
        near = hits[-1] if hits else -1
        return _Table([-1] * first + hits + self.budget.take(g.pool, fresh, near), first, k)

    def grow(self, seq: Sequence, num_new: int) -> bool:
        state = self._seqs[seq.seq_id]
        end = _cdiv(seq.num_computed_tokens + num_new, self.block)
        want = [end - len(t.blocks) if g.holds_tokens else 0
                for g, t in zip(self.groups, state.tables, strict=True)]
        want = [max(n, 0) for n in want]
        if not any(want):
            return True
        if not self.budget.room(*self._per_pool(want, [])):
            return False
        for gi, (g, n) in enumerate(zip(self.groups, want, strict=True)):
            if n > 0:
                blocks = state.tables[gi].blocks
                blocks += self.budget.take(g.pool, n, blocks[-1] if blocks else -1)
                self._counts[gi].held_blocks += n
        return True

    def commit(self, seq: Sequence) -> None:
        state = self._seqs[seq.seq_id]
        n, b = seq.num_computed_tokens, self.block
        if not state.committed <= n:
            raise RuntimeError(f"sequence {seq.seq_id}: {n} computed tokens before its "
                               f"committed {state.committed}")
        full = n // b
        hashes = self._hashes_upto(seq, full) if self.enable_prefix_caching else []
        for gi, (g, table) in enumerate(zip(self.groups, state.tables, strict=True)):
            if not g.holds_tokens:
                at = full - full % self.plan.state_every
                if hashes and at > table.indexed:
                    self._snapshot(gi, hashes[at - 1])
                    table.indexed = at
                continue
            if len(table.blocks) * b < n:
                raise RuntimeError(f"sequence {seq.seq_id}: {n} computed tokens outside "
                                   f"its {len(table.blocks)} blocks")
            self._counts[gi].written_tokens += n - state.committed
            if hashes and full > table.indexed:
                self.pools[g.pool].cache(table.blocks[table.indexed : full],
                                         self._keys(gi, hashes, table.indexed, full),
                                         0, full - table.indexed)
                table.indexed = full
            if g.kind == "sliding":
                self._release_outside(gi, table, n)
        state.committed = n

    def _snapshot(self, gi: int, key: int) -> None:
        """Keep a copy of a running state, cached under ``key``, when a block is free."""
        g = self.groups[gi]
        pool = self.pools[g.pool]
        salted = key ^ self._salts[gi]
        one = [int(i == gi) for i in range(len(self.groups))]
        if pool.cached([salted])[0] is not None or not self.budget.room(*self._per_pool(one, [])):
            return
        block = self.budget.take(g.pool, 1)
        pool.cache(block, [salted], 0, 1)
        self.budget.release(g.pool, block, 0)
        self._counts[gi].snapshots += 1

    def _release_outside(self, gi: int, table: _Table, n: int) -> None:
        """Free the blocks no query from position ``n`` on sees (they stay cached)."""
        out = self._window_start(gi, n)
        if out > table.released:
            self._drop(gi, table.blocks[table.released : out], (out - table.released) * self.block)
            table.released = out

    def _drop(self, gi: int, blocks: list[int], filled: int) -> None:
        g, c = self.groups[gi], self._counts[gi]
        ref = self.pools[g.pool].ref
        c.held_blocks -= sum(1 for blk in blocks if ref[blk] == 1)
        dead = self.budget.release(g.pool, blocks, filled)
        c.written_tokens -= dead if self.groups[gi].holds_tokens else len(blocks)

    def free(self, seq: Sequence) -> None:
        if seq.is_finished:
            self._hashes.pop(seq.seq_id, None)
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            return
        for gi, (g, table) in enumerate(zip(self.groups, state.tables, strict=True)):
            held = table.blocks[table.released :]
            filled = state.committed - table.released * self.block if g.holds_tokens else 0
            self._drop(gi, held, filled)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        raise RuntimeError("the hybrid KV policy runs one sample per request (admission "
                           "rejects n > 1)")

    # --- real compute: one pool of equal blocks (common-page, uniform) --------------------

    def layer_pools(self) -> LayerPools | None:
        if len(self.pools) > 1:
            return None  # per-group pools are simulated only (HybridPolicy.check)
        tensor_of = tuple(t for _, t in self.plan.layer_map)
        group_of = tuple(g for g, _ in self.plan.layer_map)
        return LayerPools(self.plan.tensors, self.pools[0].num_blocks * self.block, tensor_of,
                          group_of)

    def slots(self, seq: Sequence, start: int, end: int, group: int = 0) -> np.ndarray:
        """Slots of positions ``[start, end)`` of ``seq`` in allocation group ``group``."""
        table, b = self._seqs[seq.seq_id].tables[group], self.block
        if not table.released * b <= start <= end <= len(table.blocks) * b:
            raise RuntimeError(f"sequence {seq.seq_id}: positions [{start}, {end}) outside "
                               f"its blocks of group {group}")
        return table_slots(table.blocks, b, start, end)

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray,
                         group: int = 0) -> BlockTables:
        """Group ``group``'s block tables; entries released out of a window (never read by
        windowed attention) point at block 0."""
        b = self.block
        tables = np.zeros((len(seqs), int(-(-context_lens.max() // b))), dtype=np.int32)
        for i, seq in enumerate(seqs):
            n = -(-int(context_lens[i]) // b)
            tables[i, :n] = np.maximum(self._seqs[seq.seq_id].tables[group].blocks[:n], 0)
        return BlockTables(tables, b)

    def take_copies(self) -> list[SlotCopy]:
        return []

    # --- figures ----------------------------------------------------------------------------

    def stats(self) -> KVStats:
        """Reserved: blocks referenced, padding included; used: what the real layers' tokens
        and states need of them. Largest free: what every group can take (carved pools:
        the free and idle large pages)."""
        free = self.budget.free_bytes()
        caching = self.enable_prefix_caching
        groups = {g.name: self._group_stats(g, c)
                  for g, c in zip(self.groups, self._counts, strict=True)}
        return KVStats(
            capacity_bytes=self.budget.budget,
            used_bytes=sum(v["used_bytes"] for v in groups.values()),
            reserved_bytes=self.budget.reserved_bytes(), free_bytes=free,
            largest_free_bytes=self.budget.largest_free_bytes(),
            prefix_hit_tokens=self._hit_tokens if caching else None,
            prefix_query_tokens=self._query_tokens if caching else None,
            block_allocs=sum(p.num_allocs for p in self.pools),
            block_frees=sum(p.num_frees for p in self.pools),
            copied_bytes=0,
            page_table_entries=sum(c.held_blocks for c in self._counts),
            evictions=sum(p.num_evictions for p in self.pools) if caching else None,
            groups=groups,
        )

    def _group_stats(self, g: AllocGroup, c: _GroupCounts) -> dict[str, Any]:
        used = (c.written_tokens * g.token_bytes if g.holds_tokens
                else c.written_tokens * g.state_bytes)
        reserved = c.held_blocks * g.block_bytes
        out: dict[str, Any] = {
            "kind": g.kind, "layers": g.layers, "block_bytes": g.block_bytes,
            "reserved_bytes": reserved, "used_bytes": used,
            # Of the one budget every group draws on.
            "usage": reserved / self.budget.budget,
        }
        if self.enable_prefix_caching:
            out["hit_tokens"] = c.hit_tokens
            if not g.holds_tokens:
                out["snapshots"] = c.snapshots
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "layout": self.plan.layout.policy,
            "block_tokens": self.block, "budget_bytes": self.plan.budget,
            "layers_per_group": self.plan.layout.layers_per_group,
            "groups": [{"name": g.name, "kind": g.kind, "layers": g.layers,
                        "window": g.window or None, "pool": g.pool,
                        "block_bytes": g.block_bytes, "token_bytes": g.token_bytes,
                        "state_bytes": g.state_bytes} for g in self.groups],
            "pool_blocks": [p.num_blocks for p in self.pools],
            "page_bytes": self.plan.page_bytes,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": self.enable_prefix_caching,
            "eviction": self.eviction,
        }

    def _hashes_upto(self, seq: Sequence, num_blocks: int) -> list[int]:
        """``seq``'s chained block hashes, computed (once) for its first ``num_blocks``."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        have = len(hashes)
        if have < num_blocks:
            b = self.block
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes += self._hasher.chain(parent, seq.token_ids(have * b, num_blocks * b))
        return hashes
