"""Virtually contiguous, physically paged KV (vAttention, Prabhu et al., ASPLOS'25).

Each sequence owns a virtual range of ``max_model_len`` tokens per layer for K and for V, so
an unmodified kernel reads its KV as one contiguous tensor. Physical memory is mapped into
the range on demand in pages of ``page_bytes`` (2 MiB, as CUDA's virtual-memory API hands
out; 64/128/256 KiB with vAttention's modified driver), one page per layer per K/V tensor
per tensor-parallel rank. A page holds ``page_bytes / (kv_heads_per_rank x head_dim x
dtype_bytes)`` tokens, so the rounding waste at the end of every sequence depends on the
model's shape: 1024 tokens a page for Llama-3-8B at 2 MiB, 2048 for Qwen2.5-7B.

Here a *page group* is the ``2 x layers x tp`` pages that back one page's worth of tokens in
every tensor; the pool is ``num_groups`` of them. Mapping or unmapping a group is that many
``map_ops`` / ``unmap_ops``. Calls the step must wait for (a sequence needs a page that is
not mapped yet; reclaiming pages on demand) are handed to the cost model
(``take_map_ops``, costed at ``CostCoefficients.map_op_s`` each). ``prewarm_pages`` keeps
that many groups mapped ahead of need, mapped in the background while steps compute
(vAttention's eager allocation), and leaves a finished sequence's groups mapped in its
range for the next sequence (deferred reclamation), so those calls cost no step time;
without it every mapping is synchronous and a finished sequence's groups are unmapped at
once. ``prewarm = "hint"`` maps a request's hinted pages (:mod:`.prewarm`) into its range
at arrival, in the background.

On the torch executor, address translation is emulated: the block table of page groups
(``page_tokens`` tokens each) stands for the GPU's page table, so bytes and mapping counts
are exact but no virtual memory is mapped. Parallel samples reserve a range mapped for the
prompt per sample at admission (a fork cannot fail) and a fork copies the prompt's KV, as
virtually contiguous ranges cannot share pages. No prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Self

import numpy as np
from pydantic import Field, PrivateAttr

from kvbench.engines.base import KVStats
from kvbench.engines.config import EngineConfig, EngineSettings, KVPolicy
from kvbench.engines.kv.base import (
    KVManager,
    SlotCopy,
    newly_computed,
    steps_to_end,
    written_columns,
)
from kvbench.engines.kv.prewarm import Prewarm, hint_tokens
from kvbench.engines.kv.spec import Footprint, KVSpec
from kvbench.engines.sequence import Sequence
from kvbench.errors import KvbenchError
from kvbench.kernels.layouts import BlockTables
from kvbench.workloads.model import Request

KiB, MiB = 1 << 10, 1 << 20


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class VAttentionPolicy(KVPolicy):
    """Virtual ranges of ``max_model_len`` per sequence, physical pages of ``page_bytes``
    mapped on demand."""

    kind: Literal["vattention"] = "vattention"
    summary = (
        "virtually contiguous KV, physical pages (2 MiB | 64 KiB) mapped on demand per layer "
        "and K/V; map/unmap calls on the clock; address translation emulated by a block table"
    )
    # The page sizes vAttention supports: CUDA's 2 MiB, and its driver's smaller ones.
    page_bytes: Literal[65536, 131072, 262144, 2097152] = 2 * MiB
    prewarm_pages: int = Field(default=0, ge=0)
    prewarm: Prewarm = "none"
    _page_tokens: int | None = PrivateAttr(default=None)

    def resolved(self, settings: EngineSettings) -> Self:
        preset, tp = settings.preset, settings.device.tp
        per_token = preset.kv_bytes_per_token_per_rank(tp) // (2 * preset.num_layers)
        if self.page_bytes % per_token:
            raise KvbenchError(
                f"vattention: a page of {self.page_bytes} bytes holds no whole number of "
                f"{preset.name}'s {per_token}-byte tokens (one layer's K or V on one rank)"
            )
        out = self.model_copy()
        out._page_tokens = self.page_bytes // per_token
        return out

    def page_tokens(self) -> int:
        assert self._page_tokens is not None, "resolve the section first"
        return self._page_tokens

    def label(self) -> str:
        size = f"{self.page_bytes // MiB}MiB" if self.page_bytes >= MiB else (
            f"{self.page_bytes // KiB}KiB")
        extra = (f"+prewarm{self.prewarm_pages}" if self.prewarm_pages else "") + (
            "+hint" if self.prewarm == "hint" else "")
        return f"vattention/{size}{extra}"

    def footprint(self, config: EngineConfig, request: Request) -> Footprint:
        return vattention_footprint(request, config.kv.page_tokens, config.num_pages)

    def manager(self, config: EngineConfig) -> VAttentionKVManager:
        return VAttentionKVManager(
            config.num_pages, config.kv.page_tokens, config.kv.bytes_per_token,
            config.scheduler.max_model_len, ops_per_group=2 * config.preset.num_layers
            * config.device.tp, page_bytes=self.page_bytes, prewarm_pages=self.prewarm_pages,
            prewarm=self.prewarm, dtype=config.kv.dtype,
        )


def vattention_footprint(request: Request, page_tokens: int, num_groups: int) -> Footprint:
    """One sample's groups at its longest plus the prompt's groups of every other sample."""
    groups = (_cdiv(request.prompt_tokens + request.output_tokens, page_tokens)
              + (request.n - 1) * _cdiv(request.prompt_tokens, page_tokens))
    return Footprint(
        tokens=groups * page_tokens, capacity_tokens=num_groups * page_tokens,
        what=f"{groups} page groups of {page_tokens} tokens",
        capacity=f"{num_groups} page groups",
    )


@dataclass(slots=True)
class _Range:
    """A virtual range: the page groups mapped into it, in position order, and what the
    sequence holding it (if any) writes."""

    groups: list[int] = field(default_factory=list)
    final_len: int = 0  # tokens its holder writes by the end (0: no holder)
    num_committed: int = 0
    need: int = 0  # groups its holder's allocated positions use; the rest is mapped ahead
    idle_key: int | None = None  # its key among the idle ranges, while it is one


class VAttentionKVManager(KVManager):
    """vAttention bookkeeping over ``num_groups`` page groups of ``page_tokens`` slots; a
    group is ``ops_per_group`` physical pages (2 x layers x tensor-parallel ranks)."""

    kind = "vattention"

    def __init__(
        self,
        num_groups: int,
        page_tokens: int,
        bytes_per_token: int,
        max_model_len: int,
        ops_per_group: int,
        page_bytes: int = 2 * MiB,
        prewarm_pages: int = 0,
        prewarm: Prewarm = "none",
        dtype: str | None = None,
    ) -> None:
        for name, value in (("num_groups", num_groups), ("page_tokens", page_tokens),
                            ("bytes_per_token", bytes_per_token),
                            ("max_model_len", max_model_len), ("ops_per_group", ops_per_group)):
            if value <= 0:
                raise KvbenchError(f"vattention KV cache: {name} must be positive, got {value}")
        self.num_groups = num_groups
        self.page_tokens = page_tokens
        self.ops_per_group = ops_per_group
        self.page_bytes = page_bytes
        self.prewarm_pages = prewarm_pages
        self.prewarm = prewarm
        self.spec = KVSpec(page_tokens, bytes_per_token, dtype)
        self.max_model_len = max_model_len
        self.capacity_tokens = num_groups * page_tokens
        self._free = list(range(num_groups - 1, -1, -1))  # unmapped; group 0 pops first
        self._ranges: dict[int, _Range] = {}  # live sequences' ranges
        self._spare: dict[int, list[_Range]] = {}  # parent seq_id -> ranges for its forks
        self._hinted: dict[int, _Range] = {}  # waiting seq_id -> range mapped at arrival
        self._idle: dict[int, _Range] = {}  # ranges of finished sequences still mapped
        self._next_idle = 0
        self._copies: list[SlotCopy] = []
        self._mapped = 0
        self._ahead = 0  # over live ranges: groups mapped beyond their holder's need
        self._idle_groups = 0
        self._hint_groups = 0
        self._sum_limit = 0  # over held ranges: slots their holders will have written
        self._sum_committed = 0
        self._map_ops = 0
        self._unmap_ops = 0
        self._sync_ops = 0
        self._groups_mapped = 0
        self._groups_unmapped = 0
        self._copied_bytes = 0

    def footprint(self, request: Request) -> Footprint:
        return vattention_footprint(request, self.page_tokens, self.num_groups)

    def held_tokens(self, prompt: int, output: int, n: int = 1) -> int:
        return n * _cdiv(prompt + output, self.page_tokens) * self.page_tokens

    def lookup_prefix(self, seq: Sequence) -> int:
        return 0  # no prefix cache: ranges are private

    # -- admission and growth -------------------------------------------------------------

    def arrive(self, seq: Sequence) -> None:
        if self.prewarm != "hint":
            return
        groups = _cdiv(hint_tokens(seq.request), self.page_tokens)
        groups = min(groups, _cdiv(seq.max_tokens, self.page_tokens))
        if not groups or groups > len(self._free):
            return
        rng = _Range(final_len=seq.max_tokens - 1)
        self._map(rng, groups, sync=False)  # the request waits: mapped off the critical path
        self._hinted[seq.seq_id] = rng
        self._hint_groups += groups
        self._sum_limit += self._limit(rng)

    def allocate(self, seq: Sequence, num_cached: int, num_new: int) -> bool:
        if seq.seq_id in self._ranges:
            raise RuntimeError(f"sequence {seq.seq_id} is already allocated")
        if num_cached:
            raise RuntimeError("the vattention KV manager has no prefix cache")
        wanted = self._wanted(seq, num_new)
        if wanted is None:
            return False
        hinted = self._hinted.get(seq.seq_id)
        if hinted is not None:
            del self._hinted[seq.seq_id]
            self._hint_groups -= len(hinted.groups)
        final = seq.max_tokens - 1
        for i, (rng, n) in enumerate(wanted):
            self._sum_limit -= self._limit(rng)  # a hinted range was counted
            self._unpark(rng)
            rng.final_len = final
            if i == 0:
                self._ranges[seq.seq_id] = rng
                self._ahead += len(rng.groups)  # live now, all of it ahead until ensured
            self._ensure(rng, n, live=i == 0)
            self._sum_limit += self._limit(rng)
        if len(wanted) > 1:
            self._spare[seq.seq_id] = [r for r, _ in wanted[1:]]
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        return True

    def would_admit(self, seq: Sequence, num_cached: int, num_new: int) -> bool | None:
        if seq.seq_id in self._ranges or num_cached:
            return None
        return self._wanted(seq, num_new) is not None

    def _wanted(self, seq: Sequence, num_new: int) -> list[tuple[_Range, int]] | None:
        """The ranges admitting ``seq`` with ``num_new`` tokens would take, each with the
        groups it needs mapped (its own, then one per sample to fork), or None when the
        groups free, idle, hinted and mapped ahead fall short."""
        t = self.page_tokens
        hinted = self._hinted.get(seq.seq_id)
        wanted = [(hinted or self._best_idle(_cdiv(num_new, t), []), _cdiv(num_new, t))]
        # Sample 0 before its prefill will fork the other samples right after it.
        if seq.sample_index == 0 and not seq.output_ids:
            prompt = _cdiv(seq.num_prompt_tokens, t)
            for _ in range(seq.request.n - 1):
                wanted.append((self._best_idle(prompt, [r for r, _ in wanted]), prompt))
        missing = sum(max(n - len(r.groups), 0) for r, n in wanted)
        chosen_idle = sum(len(r.groups) for r, _ in wanted if r.idle_key is not None)
        own_hint = len(hinted.groups) if hinted is not None else 0
        if missing > (len(self._free) + self._idle_groups - chosen_idle
                      + self._hint_groups - own_hint + self._ahead):
            return None
        return wanted

    def grow(self, seq: Sequence, num_new: int) -> bool:
        rng = self._ranges[seq.seq_id]
        need = _cdiv(seq.num_computed_tokens + num_new, self.page_tokens)
        have = len(rng.groups)
        if need <= rng.need:
            return True  # the common decode step: room left in the last page
        if need > have and need - have > len(self._free) + self._idle_groups + (
            self._hint_groups + self._ahead - (have - rng.need)
        ):
            return False
        limit = self._limit(rng)
        self._ensure(rng, need, live=True)
        self._sum_limit += self._limit(rng) - limit
        return True

    def commit(self, seq: Sequence) -> None:
        rng = self._ranges[seq.seq_id]
        new = newly_computed(seq, rng.num_committed, rng.need * self.page_tokens, "mapped pages")
        self._sum_committed += new
        rng.num_committed += new

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s range (or its hinted one) and unforked spares; their groups stay
        mapped for the next sequences when prewarming, else they are unmapped now."""
        hinted = self._hinted.pop(seq.seq_id, None)
        if hinted is not None:
            self._hint_groups -= len(hinted.groups)
            self._release(hinted)
        rng = self._ranges.pop(seq.seq_id, None)
        if rng is None:
            return
        self._sum_committed -= rng.num_committed
        self._ahead -= len(rng.groups) - rng.need
        self._release(rng)
        for spare in self._spare.pop(seq.seq_id, []):
            self._release(spare)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self._ranges:
            raise RuntimeError(f"sequence {child.seq_id} is already allocated")
        spare = self._spare.get(parent.seq_id)
        if not spare:
            raise RuntimeError(f"sequence {parent.seq_id} has no range reserved for a fork")
        rng = spare.pop()
        if not spare:
            del self._spare[parent.seq_id]
        src, t = self._ranges[parent.seq_id], self.page_tokens
        n = src.num_committed
        for j in range(_cdiv(n, t)):
            num = min(t, n - j * t)
            self._copies.append(SlotCopy(src.groups[j] * t, rng.groups[j] * t, num))
            self._copied_bytes += num * self.bytes_per_token
        rng.num_committed = n
        rng.need = _cdiv(n, t)
        self._ahead += len(rng.groups) - rng.need
        self._sum_committed += n
        self._ranges[child.seq_id] = rng

    # -- layout ---------------------------------------------------------------------------

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        rng, t = self._ranges[seq.seq_id], self.page_tokens
        if not 0 <= start <= end <= len(rng.groups) * t:
            raise RuntimeError(
                f"sequence {seq.seq_id}: positions [{start}, {end}) outside its "
                f"{len(rng.groups)} mapped page groups"
            )
        pos = np.arange(start, end, dtype=np.int64)
        return np.asarray(rng.groups, dtype=np.int64)[pos // t] * t + pos % t

    def mapped_groups(self, seq: Sequence) -> list[int]:
        """The page groups mapped into ``seq``'s range, in position order."""
        return list(self._ranges[seq.seq_id].groups)

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> BlockTables:
        t = self.page_tokens
        tables = np.zeros((len(seqs), int(-(-context_lens.max() // t))), dtype=np.int32)
        for i, seq in enumerate(seqs):
            n = -(-int(context_lens[i]) // t)
            tables[i, :n] = self._ranges[seq.seq_id].groups[:n]
        return BlockTables(tables, t)

    def take_copies(self) -> list[SlotCopy]:
        copies, self._copies = self._copies, []
        return copies

    def take_map_ops(self) -> int:
        ops, self._sync_ops = self._sync_ops, 0
        return ops

    def background(self) -> None:
        """Keep ``prewarm_pages`` groups mapped ahead of need: the next group of running
        sequences that will need one, then idle ranges; unmap idle ranges beyond that."""
        target = self.prewarm_pages
        if not target:
            return
        t = self.page_tokens
        for rng in self._ranges.values():
            if self._ahead + self._idle_groups >= target or not self._free:
                break
            if len(rng.groups) == rng.need and len(rng.groups) * t < rng.final_len:
                limit = self._limit(rng)
                self._map(rng, 1, sync=False)
                self._ahead += 1
                self._sum_limit += self._limit(rng) - limit
        while self._ahead + self._idle_groups < target and self._free:
            rng = self._idle.get(self._next_idle - 1)
            if rng is None:
                rng = _Range()
                self._park(rng)
            self._map(rng, 1, sync=False)
            self._idle_groups += 1
        while self._idle and self._ahead + self._idle_groups > target:
            self._reclaim(1, sync=False)

    def stats(self) -> KVStats:
        """Reserved bytes are mapped page groups (ranges of running, waiting-with-a-hint and
        finished sequences alike); ``page_table_entries`` counts the physical pages mapped
        (each is one GPU page-table entry); ``block_allocs`` / ``block_frees`` count page
        groups mapped / unmapped; any unmapped group serves any range, so largest free =
        free."""
        bpt, group_bytes = self.bytes_per_token, self.page_tokens * self.bytes_per_token
        free = len(self._free) * group_bytes
        return KVStats(
            capacity_bytes=self.num_groups * group_bytes,
            used_bytes=self._sum_committed * bpt,
            reserved_bytes=self._mapped * group_bytes,
            reserved_ahead_bytes=(self._sum_limit - self._sum_committed) * bpt,
            free_bytes=free,
            largest_free_bytes=free,
            shared_bytes=0,
            block_allocs=self._groups_mapped,
            block_frees=self._groups_unmapped,
            copied_bytes=self._copied_bytes,
            page_table_entries=self._mapped * self.ops_per_group,
            map_ops=self._map_ops,
            unmap_ops=self._unmap_ops,
        )

    # -- decode fast-forward ----------------------------------------------------------------

    def works_between_steps(self) -> bool:
        return self.prewarm_pages > 0

    def decode_room(self, seqs: list[Sequence], max_steps: int, keep_cached: bool = False) -> int:
        """Steps before a sequence writes past the groups mapped into its range: mapping
        one is a call the step waits for, as are calls still to be waited for."""
        if self._copies or self._sync_ops:
            return 0

        def held(seq: Sequence) -> tuple[int, int]:
            rng = self._ranges[seq.seq_id]
            return rng.num_committed, len(rng.groups) * self.page_tokens

        return steps_to_end(seqs, max_steps, held)

    def advance_decode(self, seqs: list[Sequence], steps: int) -> dict[str, np.ndarray]:
        """Each step writes one slot per sequence into groups already mapped: only the
        written slots change, and a group mapped ahead becomes needed when reached."""
        t, n, committed = self.page_tokens, len(seqs), self._sum_committed
        for seq in seqs:
            rng = self._ranges[seq.seq_id]
            need = max(rng.need, _cdiv(seq.num_computed_tokens + steps, t))
            self._ahead -= need - rng.need
            rng.need = need
            rng.num_committed += steps
        self._sum_committed += n * steps
        return written_columns(n, steps, self.bytes_per_token, committed, committed,
                               self._sum_limit)

    def describe(self) -> dict[str, Any]:
        t = self.page_tokens
        return {
            "kind": self.kind,
            "num_page_groups": self.num_groups,
            "page_bytes": self.page_bytes,
            "page_tokens": t,
            "pages_per_group": self.ops_per_group,
            "virtual_bytes_per_sequence": _cdiv(self.max_model_len, t) * t * self.bytes_per_token,
            "bytes_per_token": self.bytes_per_token,
            "max_model_len": self.max_model_len,
            "prewarm_pages": self.prewarm_pages,
            "prewarm": self.prewarm,
            "address_translation": (
                f"emulated: a block table of {t}-token page groups stands for the GPU page "
                "table; bytes and mapping counts are exact, no virtual memory is mapped"
            ),
        }

    # -- ranges and groups ----------------------------------------------------------------

    def _best_idle(self, groups: int, taken: list[_Range]) -> _Range:
        """vAttention's choice of a range for a new sequence: the idle range with the fewest
        groups that still covers ``groups``, else the one with the most, else a new one
        (virtual ranges cost no memory); ``taken`` are already chosen."""
        best: _Range | None = None
        for rng in self._idle.values():
            if any(rng is r for r in taken):
                continue
            if best is None:
                best = rng
                continue
            n, b = len(rng.groups), len(best.groups)
            if (n >= groups and (b < groups or n < b)) or (b < groups and n > b):
                best = rng
        return best if best is not None else _Range()

    def _ensure(self, rng: _Range, need: int, live: bool) -> None:
        """Make ``need`` groups of a held range usable, mapping (synchronously) what is
        missing, reclaiming first if the free groups fall short; the caller checked there
        is room. A live range's groups past ``need`` count as mapped ahead."""
        have = len(rng.groups)
        if live:
            self._ahead -= min(need, have) - min(rng.need, have)
        if need > have:
            short = need - have - len(self._free)
            if short > 0:
                self._reclaim(short, sync=True, keep=rng)
            self._map(rng, need - have, sync=True)
        rng.need = max(rng.need, need)

    def _release(self, rng: _Range) -> None:
        """A held range's holder is gone: park its groups (prewarming) or unmap them."""
        self._sum_limit -= self._limit(rng)
        rng.final_len = rng.num_committed = rng.need = 0
        if not rng.groups:
            return
        if self.prewarm_pages:
            self._park(rng)
        else:
            self._unmap(rng, len(rng.groups), sync=True)

    def _park(self, rng: _Range) -> None:
        rng.idle_key = self._next_idle
        self._idle[self._next_idle] = rng
        self._idle_groups += len(rng.groups)
        self._next_idle += 1

    def _unpark(self, rng: _Range) -> None:
        if rng.idle_key is not None:
            del self._idle[rng.idle_key]
            self._idle_groups -= len(rng.groups)
            rng.idle_key = None

    def _reclaim(self, groups: int, sync: bool, keep: _Range | None = None) -> None:
        """Unmap ``groups`` groups: idle ranges' first (oldest first), then waiting
        requests' hinted ones (newest first: a hint gives way to running sequences), then
        groups live ranges mapped ahead of need."""
        while groups > 0 and self._idle:
            rng = next(iter(self._idle.values()))
            n = min(groups, len(rng.groups))
            self._unmap(rng, n, sync)
            self._idle_groups -= n
            groups -= n
            if not rng.groups:
                self._unpark(rng)
        while groups > 0 and self._hinted:
            seq_id, rng = next(reversed(self._hinted.items()))
            n = min(groups, len(rng.groups))
            limit = self._limit(rng)
            self._unmap(rng, n, sync)
            self._sum_limit += self._limit(rng) - limit
            self._hint_groups -= n
            groups -= n
            if not rng.groups:
                del self._hinted[seq_id]
        for rng in self._ranges.values():
            if groups <= 0:
                break
            extra = len(rng.groups) - rng.need
            if rng is keep or extra <= 0:
                continue
            n = min(groups, extra)
            limit = self._limit(rng)
            self._unmap(rng, n, sync)
            self._sum_limit += self._limit(rng) - limit
            self._ahead -= n
            groups -= n
        assert groups <= 0, "caller checked the reclaimable groups"

    def _map(self, rng: _Range, n: int, sync: bool) -> None:
        free = self._free
        rng.groups += free[len(free) - n :][::-1]
        del free[len(free) - n :]
        self._mapped += n
        self._groups_mapped += n
        ops = n * self.ops_per_group
        self._map_ops += ops
        if sync:
            self._sync_ops += ops

    def _unmap(self, rng: _Range, n: int, sync: bool) -> None:
        """Unmap the last ``n`` groups of ``rng`` (the end of its range)."""
        groups = rng.groups
        self._free += groups[len(groups) - n :]
        del groups[len(groups) - n :]
        self._mapped -= n
        self._groups_unmapped += n
        ops = n * self.ops_per_group
        self._unmap_ops += ops
        if sync:
            self._sync_ops += ops

    def _limit(self, rng: _Range) -> int:
        return min(len(rng.groups) * self.page_tokens, rng.final_len)
