"""Offload tiers below device memory: where a paged prefix cache's evicted blocks go.

A block the device pool evicts to make room is stored in the first tier (host memory, a
CXL expander, or disk) instead of being dropped; a tier over its capacity sends its own
evictees one tier down, and the last tier drops them. A prefix lookup that runs out of
device blocks goes on through the tiers, block by block, and a request that hits there
loads those blocks into fresh device blocks before its prefill. Tiers are exclusive: a
loaded block leaves its tier, and a block computed again on the device supersedes a copy
held below (no key is held in two places).

Transfers are priced by the tier's link: its peak rate from the sources in :data:`LINKS`
(or a rate given by hand). Loads are on the critical path (the step waits for them, or
overlaps them layer by layer); stores run behind the step and cost it no time, as the
offloading connectors copy evicted blocks asynchronously.

Each tier evicts by ``lru``, ``lfu`` (prefix hits its content served, then age) or
``cost``: it keeps the blocks that would cost most to recompute against loading them
(prefill FLOPs of the block at its depth, attention included, on the simulated device),
weighted by hits + 1.

With ``preemption = "swap"`` a preempted sequence's blocks are copied to the first tier,
where they stay (their room taken from its cached blocks, which go down) until the
sequence resumes and they are copied back; both copies stall the step, as vLLM's swaps
did. Leading blocks still cached on the device when it resumes are not copied back.

On real compute the one ``cpu`` tier is real: :class:`HostSlots` gives each block it holds a
slot of a host buffer the executor allocates, and queues the copies (device to host as a
block is evicted, host to device as it is loaded) that the executor makes, in order, before
the next step's compute. Their seconds are measured instead of priced.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import itemgetter, sub
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from kvbench.engines.kv.key_queue import Keys, as_ints, key_array, key_queue
from kvbench.errors import KvbenchError
from kvbench.units import parse_bytes

TierKind = Literal["cpu", "cxl", "disk"]
TIER_KINDS: tuple[str, ...] = ("cpu", "cxl", "disk")
TierEviction = Literal["lru", "lfu", "cost"]
TIER_EVICTIONS: tuple[str, ...] = ("lru", "lfu", "cost")
Overlap = Literal["none", "layerwise"]
# What a preempted sequence's KV becomes: freed and computed again, or copied to a tier.
Preemption = Literal["recompute", "swap"]


@dataclass(frozen=True, slots=True)
class Link:
    """A path between device memory and a tier: its peak rate each way and where the
    figure comes from."""

    name: str
    load_bytes_per_s: float
    store_bytes_per_s: float
    source: str


# Raw link peaks, per direction; achieved copies reach less (pinned host copies ~80% of a
# PCIe link), which a rate given by hand (`@25GBps`) models.
LINKS: dict[str, Link] = {
    "pcie4": Link("pcie4", 31.5e9, 31.5e9, "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b"),
    "pcie5": Link("pcie5", 63.0e9, 63.0e9, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b"),
    "cxl": Link("cxl", 31.5e9, 31.5e9,
                "CXL 2.0 type-3 memory expander on PCIe 5.0 x8 (32 GT/s x 8 lanes)"),
    "nvme-gen4": Link("nvme-gen4", 7.45e9, 6.9e9,
                      "PCIe 4.0 x4 NVMe SSD, sequential read/write (Samsung 990 PRO datasheet)"),
    "nvme-gen5": Link("nvme-gen5", 14.8e9, 13.4e9,
                      "PCIe 5.0 x4 NVMe SSD, sequential read/write (Samsung 9100 PRO datasheet)"),
}

# A GPU's host link: PCIe 5.0 on Hopper, 4.0 before (and for a device of unknown make).
_HOST_LINK = {"h100-sxm": "pcie5", "h200": "pcie5"}
_DEFAULT_LINK = {"cxl": "cxl", "disk": "nvme-gen4"}
_TIER_RE = re.compile(
    r"^(?P<kind>[a-z]+):(?P<size>[^:@]+)(?::(?P<eviction>[a-z]+))?(?:@(?P<link>[\w.-]+))?$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)GBps$", re.IGNORECASE)
TIER_SYNTAX = "KIND:SIZE[:lru|lfu|cost][@LINK], e.g. cpu:64GiB,disk:1TiB:lfu@nvme-gen5"


def link(name: str) -> Link:
    """A link by name, or a symmetric rate such as ``25GBps``."""
    if name in LINKS:
        return LINKS[name]
    m = _RATE_RE.match(name)
    if m and float(m.group(1)) > 0:
        rate = float(m.group(1)) * 1e9
        return Link(name, rate, rate, "given")
    raise KvbenchError(
        f"unknown offload link {name!r}: use one of {', '.join(LINKS)} or a rate such as 25GBps")


class TierSpec(BaseModel):
    """One tier: its kind, capacity, eviction rule and link (None: the kind's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: TierKind
    size: str
    eviction: TierEviction = "lru"
    link: str | None = None

    @model_validator(mode="after")
    def _check(self) -> TierSpec:
        parse_bytes(self.size, f"offload tier {self.kind}")
        if self.link is not None:
            link(self.link)
        return self

    @property
    def size_bytes(self) -> int:
        return parse_bytes(self.size, f"offload tier {self.kind}")

    def link_for(self, gpu: str | None) -> Link:
        if self.link is not None:
            return link(self.link)
        if self.kind == "cpu":
            return LINKS[_HOST_LINK.get(gpu or "", "pcie4")]
        return LINKS[_DEFAULT_LINK[self.kind]]

    def label(self) -> str:
        rule = "" if self.eviction == "lru" else f":{self.eviction}"
        return f"{self.kind}:{self.size}{rule}" + (f"@{self.link}" if self.link else "")


class OffloadSpec(BaseModel):
    """Tiers in order below device memory, and whether loads overlap compute layer by
    layer. Written as a table or as the flag's text (:data:`TIER_SYNTAX`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tiers: tuple[TierSpec, ...]
    overlap: Overlap = "none"

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"tiers": parse_tiers(data)}
        if isinstance(data, dict) and isinstance(data.get("tiers"), str):
            return {**data, "tiers": parse_tiers(data["tiers"])}
        return data

    @model_validator(mode="after")
    def _check(self) -> OffloadSpec:
        kinds = [t.kind for t in self.tiers]
        if not kinds:
            raise KvbenchError(f"offload needs at least one tier: write {TIER_SYNTAX}")
        if len(set(kinds)) != len(kinds):
            raise KvbenchError(f"offload tiers repeat a kind ({','.join(kinds)}): one of each")
        return self

    def label(self) -> str:
        return "+".join(t.label() for t in self.tiers) + (
            "/layerwise" if self.overlap == "layerwise" else "")


def parse_tiers(text: str) -> list[dict[str, str]]:
    """The tiers of ``cpu:64GiB,disk:1TiB`` (:data:`TIER_SYNTAX`) as tables."""
    out = []
    for part in text.split(","):
        m = _TIER_RE.match(part.strip())
        if not m:
            raise KvbenchError(f"offload tier {part.strip()!r}: write {TIER_SYNTAX}")
        kind, eviction = m.group("kind"), m.group("eviction")
        if kind not in TIER_KINDS:
            raise KvbenchError(f"offload tier kind {kind!r}: use one of {', '.join(TIER_KINDS)}")
        if eviction is not None and eviction not in TIER_EVICTIONS:
            raise KvbenchError(
                f"offload tier eviction {eviction!r}: use one of {', '.join(TIER_EVICTIONS)}")
        out.append({k: v for k, v in m.groupdict().items() if v is not None})
    return out


class Tier:
    """One tier's keys (exclusive of every other tier's), its queue and its counters."""

    def __init__(self, spec: TierSpec, block_tokens: int, block_bytes: int, gpu: str | None,
                 recompute_s: Callable[[int], float], ranks: int) -> None:
        self.spec, self.kind = spec, spec.kind
        self.link = spec.link_for(gpu)
        self.block_bytes, self.block_tokens = block_bytes, block_tokens
        self.capacity_blocks = spec.size_bytes // block_bytes
        if self.capacity_blocks < 1:
            raise KvbenchError(
                f"offload tier {spec.kind}:{spec.size} holds no KV block of {block_bytes} "
                "bytes: give it more room")
        self.hits: dict[int, int] = {}
        self._recompute_s = recompute_s
        # Each tensor-parallel rank moves its share of a block over a link of its own.
        self.load_block_s = block_bytes / (ranks * self.link.load_bytes_per_s)
        self.store_block_s = block_bytes / (ranks * self.link.store_bytes_per_s)
        self.queue = key_queue(spec.eviction == "lru")
        self._recompute = np.zeros(0)
        self.loaded_blocks = self.stored_blocks = self.dropped_blocks = 0
        # Blocks of swapped-out sequences held here (never evicted), and blocks swapped.
        self.pinned = self.swapped_out_blocks = self.swapped_in_blocks = 0
        self.load_s = self.store_s = 0.0
        # Prefill seconds the loads spared (recomputing those blocks), less the loads'.
        self.saved_s = 0.0
        # False where the copies are real and their seconds measured (HostSlots).
        self.priced = True

    def __len__(self) -> int:
        return len(self.queue) + self.pinned

    def add(self, keys: Keys, hits: list[int] | None, depth: dict[int, int]) -> None:
        """Take ``keys`` with their hit counts (None: none; ``depth``: the block depths the
        cost rule prices recomputing by)."""
        if hits is not None and any(hits):
            self.hits.update(filter(itemgetter(1), zip(keys, hits, strict=True)))
        rule = self.spec.eviction
        if rule == "lru":
            self.queue.add_many(keys)
        else:
            # lfu ranks a key by its hits, cost by (hits + 1) x (recompute - load) seconds.
            ranks: list[int] | np.ndarray = hits if hits is not None else [0] * len(keys)
            if rule == "cost":
                d = np.fromiter(map(depth.get, as_ints(keys), repeat(0)), np.int64, len(keys))
                ranks = (np.asarray(ranks, dtype=np.int64) + 1) * (
                    self._recompute_table(int(d.max()) + 1)[d] - self.load_block_s)
            self.queue.add_ranked(keys, ranks)  # type: ignore[union-attr]
        self.stored_blocks += len(keys)

    def _recompute_table(self, n: int) -> np.ndarray:
        """Seconds to recompute a block at each depth, for at least ``n`` depths."""
        table = self._recompute
        if len(table) < n:
            table = self._recompute = np.array(
                [self._recompute_s(d) for d in range(max(n, 2 * len(table)))])
        return table

    def priced_loads(self, first_depth: int, n: int, pending_s: float) -> float:
        """Blocks at depths ``first_depth ..`` of their sequence, ``n`` of them, loaded over
        the link: ``pending_s`` with their seconds added. Sums go one block at a time, as
        loads made one by one add up."""
        s = self.load_block_s
        self.load_s = _sum_onto(self.load_s, repeat(s, n))
        self.saved_s = _sum_onto(self.saved_s, map(
            sub, map(self._recompute_s, range(first_depth, first_depth + n)), repeat(s)))
        return _sum_onto(pending_s, repeat(s, n))

    def take(self, keys: Keys) -> list[int]:
        """Remove ``keys`` (held here); their hit counts."""
        self.queue.remove_many(keys)
        return self._hits_of(keys)

    def discard(self, keys: Keys) -> list[int]:
        """Remove those of ``keys`` held here: them."""
        gone = self.queue.discard(keys)
        self._hits_of(gone)
        return gone

    def overflow(self) -> tuple[Keys, list[int] | None]:
        """Keys, and their hit counts (None: none), evicted to bring the tier within its
        capacity."""
        n = len(self) - self.capacity_blocks
        if n <= 0:
            return [], None
        keys = self.queue.evict(n)
        return keys, self._hits_of(keys) if self.hits else None

    def _hits_of(self, keys: Keys) -> list[int]:
        """The hit counts of ``keys``, leaving (zeros where none is kept)."""
        if not self.hits:
            return [0] * len(keys)
        pop = self.hits.pop
        return [pop(key, 0) for key in as_ints(keys)]

    def stats(self) -> dict[str, Any]:
        bb = self.block_bytes
        stored = self.stored_blocks + self.swapped_out_blocks
        return {
            "capacity_bytes": self.capacity_blocks * bb,
            "used_bytes": len(self) * bb,
            "hit_tokens": self.loaded_blocks * self.block_tokens,
            "loaded_bytes": (self.loaded_blocks + self.swapped_in_blocks) * bb,
            "stored_bytes": stored * bb,
            "swapped_out_bytes": self.swapped_out_blocks * bb,
            "swapped_in_bytes": self.swapped_in_blocks * bb,
            "swap_held_bytes": self.pinned * bb,
            "dropped_blocks": self.dropped_blocks,
            "load_s": self.load_s,
            # Priced stores all move at the link's rate; real ones were measured.
            "store_s": stored * self.store_block_s if self.priced else self.store_s,
            "saved_s": self.saved_s if self.priced else None,
        }


class HostSlots:
    """Slots of the host buffer behind a real engine's cpu tier: one per block the tier
    holds, plus one per block of an admission in flight (loaded, not yet placed), and the
    copies queued for the executor as ``(device block, slot, to_host)``, in order."""

    def __init__(self, capacity_blocks: int, in_flight_blocks: int) -> None:
        self.count = capacity_blocks + in_flight_blocks
        self.slot: dict[int, int] = {}
        self.swapped: dict[int, list[int]] = {}  # a swapped-out sequence's slots
        self._free = list(range(self.count - 1, -1, -1))
        self._loading: list[int] = []
        self.moves: list[tuple[int, int, bool]] = []

    def store(self, block: int, key: int) -> None:
        slot = self._free.pop()
        self.slot[key] = slot
        self.moves.append((block, slot, True))

    def release(self, key: int) -> None:
        slot = self.slot.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def load(self, key: int) -> None:
        """``key`` leaves the tier; its slot stays taken until :meth:`place` copies it."""
        self._loading.append(self.slot.pop(key))

    def place(self, blocks: list[int]) -> None:
        """The device blocks the keys of the last :meth:`load` calls go to, in order."""
        for block, slot in zip(blocks, self._loading, strict=True):
            self.moves.append((block, slot, False))
            self._free.append(slot)
        self._loading = []

    def swap_out(self, seq_id: int, blocks: list[int]) -> None:
        """Slots for swapped-out sequence ``seq_id``'s ``blocks``, copied there."""
        slots = self.swapped[seq_id] = [self._free.pop() for _ in blocks]
        self.moves += zip(blocks, slots, repeat(True))

    def swap_in(self, seq_id: int, blocks: list[int]) -> None:
        """Sequence ``seq_id``'s slots freed, the last ``len(blocks)`` copied into
        ``blocks``."""
        slots = self.swapped.pop(seq_id)
        skip = len(slots) - len(blocks)
        self.moves += zip(blocks, slots[skip:], repeat(False))
        self._free += slots

    def take_moves(self) -> list[tuple[int, int, bool]]:
        moves, self.moves = self.moves, []
        return moves


class OffloadTiers:
    """The tiers below a paged pool, in order (each holds keys no other does)."""

    def __init__(self, spec: OffloadSpec, block_tokens: int, block_bytes: int, gpu: str | None,
                 recompute_s: Callable[[int], float], ranks: int = 1,
                 host_in_flight: int | None = None) -> None:
        """``host_in_flight``: the tiers are real (one cpu tier, :class:`HostSlots`), and
        one admission loads at most this many blocks."""
        self.spec = spec
        self.tiers = [Tier(t, block_tokens, block_bytes, gpu, recompute_s, ranks)
                      for t in spec.tiers]
        self.host: HostSlots | None = None
        if host_in_flight is not None:
            if [t.kind for t in self.tiers] != ["cpu"]:
                raise KvbenchError("real compute keeps one cpu offload tier in host memory")
            self.tiers[0].priced = False
            self.host = HostSlots(self.tiers[0].capacity_blocks, host_in_flight)
        self.tracks_depth = any(t.spec.eviction == "cost" for t in self.tiers)
        self._depth: dict[int, int] = {}
        self._pending_load_s = 0.0
        self._swapped: dict[int, int] = {}  # blocks each swapped-out sequence holds

    def note_depths(self, keys: list[int], start: int, end: int) -> None:
        """Keys ``keys[start:end]`` sit at those block depths of their sequence (the
        ``cost`` rule prices recomputing a block by its depth)."""
        if self.tracks_depth:
            self._depth.update(zip(keys[start:end], range(start, end), strict=True))

    def store(self, blocks: list[int], keys: Keys, hits: list[int] | None,
              depths: list[int] | None = None) -> None:
        """Device ``blocks`` evicted, caching ``keys`` (with ``hits``, their hit counts;
        None: none; and their depths where :meth:`note_depths` did not give them): into the
        first tier, cascading overflow down."""
        if depths is not None and self.tracks_depth:
            self._depth.update(zip(as_ints(keys), depths, strict=True))
        dropped = self._cascade(keys, hits)
        if self.host is not None:
            self._copy_out(blocks, as_ints(keys), dropped)

    def _cascade(self, keys: Keys, hits: list[int] | None) -> Keys:
        """``keys`` into the first tier and each tier's overflow into the next: the keys
        the last tier drops."""
        for tier in self.tiers:
            if len(keys):
                tier.add(keys, hits, self._depth)
            keys, hits = tier.overflow()
            if not keys:
                return []
        self.tiers[-1].dropped_blocks += len(keys)
        if self.tracks_depth:
            deque(map(self._depth.pop, keys, repeat(None)), maxlen=0)
        return keys

    def swapped(self, seq_id: int) -> bool:
        return seq_id in self._swapped

    def swap_out(self, seq_id: int, blocks: list[int]) -> bool:
        """Copy preempted sequence ``seq_id``'s ``blocks`` to the first tier, whose cached
        blocks make room by going down; False, changing nothing, where the blocks already
        swapped leave too little room."""
        tier = self.tiers[0]
        n = len(blocks)
        if tier.pinned + n > tier.capacity_blocks:
            return False
        tier.pinned += n
        tier.swapped_out_blocks += n
        self._swapped[seq_id] = n
        dropped = self._cascade([], [])
        if tier.priced:
            self._pending_load_s += n * tier.store_block_s
        else:
            assert self.host is not None
            for key in dropped:
                self.host.release(key)
            self.host.swap_out(seq_id, blocks)
        return True

    def swap_in(self, seq_id: int, blocks: list[int]) -> None:
        """Copy swapped sequence ``seq_id``'s last blocks back into device ``blocks`` (the
        ones before them were found still cached on the device)."""
        tier = self.tiers[0]
        tier.pinned -= self._swapped.pop(seq_id)
        tier.swapped_in_blocks += len(blocks)
        if tier.priced:
            s = len(blocks) * tier.load_block_s
            tier.load_s += s
            self._pending_load_s += s
        else:
            assert self.host is not None
            self.host.swap_in(seq_id, blocks)

    def _copy_out(self, blocks: list[int], keys: list[int], dropped: list[int]) -> None:
        """Slots for the stored blocks the (only) tier kept, after freeing the dropped."""
        host, tier = self.host, self.tiers[0]
        assert host is not None
        for key in dropped:
            host.release(key)
        for block, key in zip(blocks, keys, strict=True):
            if key in tier.queue:
                host.store(block, key)

    def run(self, keys: Keys) -> int:
        """How many leading ``keys`` some tier holds."""
        runs = self._runs(key_array(keys))
        return runs[-1][2] if runs else 0

    def _runs(self, keys: Keys) -> list[tuple[Tier, int, int]]:
        """The leading ``keys`` the tiers hold, as runs held by one tier each: (tier,
        start, end), in order."""
        tiers, out = self.tiers, []
        n = idle = i = 0
        while idle < len(tiers):
            tier = tiers[i % len(tiers)]
            i += 1
            r = tier.queue.run(keys, n)
            if r:
                out.append((tier, n, n + r))
                n += r
                idle = 1  # the key now first is not this tier's
            else:
                idle += 1
        return out

    def load(self, keys: Keys, first_depth: int = 0) -> list[int]:
        """Move ``keys`` (all held; blocks ``first_depth``, ``first_depth`` + 1, ... of
        their sequence) up to the device: their hit counts. The transfer time waits for the
        next step (:meth:`take_load_s`)."""
        out: list[int] = []
        if self.tracks_depth:
            deque(map(self._depth.pop, as_ints(keys), repeat(None)), maxlen=0)
        keys = key_array(keys)
        runs = self._runs(keys)
        if not runs or runs[-1][2] != len(keys):
            raise RuntimeError("loading blocks the offload tiers do not hold")
        for tier, a, b in runs:
            ks = keys[a:b]
            out += tier.take(ks)
            tier.loaded_blocks += b - a
            if tier.priced:
                self._pending_load_s = tier.priced_loads(first_depth + a, b - a,
                                                         self._pending_load_s)
            else:
                assert self.host is not None
                for key in as_ints(ks):
                    self.host.load(key)
        return out

    def measured(self, store_s: float, load_s: float) -> None:
        """Seconds the executor took to make the real copies :class:`HostSlots` queued."""
        self.tiers[0].store_s += store_s
        self.tiers[0].load_s += load_s

    def discard(self, keys: Keys) -> None:
        """Drop copies of ``keys`` the device now holds afresh."""
        keys = key_array(keys)
        for tier in self.tiers:
            for key in tier.discard(keys):
                self._depth.pop(key, None)
                if self.host is not None:
                    self.host.release(key)

    def take_load_s(self) -> float:
        s, self._pending_load_s = self._pending_load_s, 0.0
        return s

    def stats(self) -> dict[str, dict[str, Any]]:
        return {t.kind: t.stats() for t in self.tiers}

    def kv_fields(self) -> dict[str, Any]:
        """The tiers' KVStats fields: each tier's figures, and their sums."""
        tiers = self.stats()
        out: dict[str, Any] = {f"offload_{name}": sum(t[name] for t in tiers.values())
                               for name in _SUMMED}
        out["offload_tiers"] = tiers
        return out

    def held_bytes(self) -> tuple[int, ...]:
        """The bytes each tier holds now, in order."""
        return tuple(len(t) * t.block_bytes for t in self.tiers)

    def describe(self) -> dict[str, Any]:
        return {"overlap": self.spec.overlap, "real_copies": self.host is not None, "tiers": [
            {"kind": t.kind, "capacity_blocks": t.capacity_blocks, "link": t.link.name,
             "load_bytes_per_s": t.link.load_bytes_per_s,
             "store_bytes_per_s": t.link.store_bytes_per_s, "link_source": t.link.source,
             "eviction": t.spec.eviction} for t in self.tiers]}


# The per-tier figures whose sums over the tiers are KVStats fields (offload_<name>).
_SUMMED = ("hit_tokens", "loaded_bytes", "stored_bytes", "load_s", "store_s", "used_bytes",
           "swapped_out_bytes", "swapped_in_bytes")


def _sum_onto(start: float, values: Iterable[float]) -> float:
    """``start`` plus ``values``, added one after another."""
    return deque(accumulate(values, initial=start), maxlen=1)[0]
