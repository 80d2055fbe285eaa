"""Modality-aware KV (the field reports' P7 and P8): text and vision (image and audio) tokens
in their own page classes, each with its own page size and storage precision.

Each KV position belongs to the class of its segment's modality (generated tokens are text).
A class stores its tokens in pages of ``page_tokens`` slots in its ``kv_dtype``; int8 / fp8
codes keep one float32 scale per ``scale_group`` slots and KV head in a side table
(:mod:`kvbench.kernels.quant`), held back from the budget first.

``pools = "shared"``: both classes take pages from one buddy pool of units (the smallest
class page); ``"split"``: one pool per class, ``vision_share`` of the budget for vision. Each
class has its own slot space (:class:`~kvbench.engines.kv.page_classes.PoolClass`), laid one
after the other (text first) in the manager's flat slots; an executor views a pool's bytes
per class (:mod:`kvbench.engines.kv.class_pools`) and merges attention over the classes by
log-sum-exp. Forks share pages of both classes, copy-on-write per class
(:class:`~kvbench.kernels.slot_copy.SlotCopy` in the flat slots).

Prefix caching keys a full page of either class by the chained hash of every token of both
classes up to its end; each class keeps its own index and reference counts, each pool an LRU
queue of cached free pages. The user-facing rules (where a hit ends, eviction, capacity):
docs/policies.md, "Modality-aware KV".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from kvbench.engines.base import KVStats
from kvbench.engines.config import EngineConfig, KVPolicy, Paging
from kvbench.engines.kv.base import KVManager, steps_within
from kvbench.engines.kv.buddy import BuddyPool
from kvbench.engines.kv.eviction import LRUQueue
from kvbench.engines.kv.hashing import ROOT_HASH, BlockHasher
from kvbench.engines.kv.page_classes import (
    KV_DTYPES,
    QUANTISED,
    SCALE_BYTES,
    ClassTables,
    PoolClass,
)
from kvbench.engines.kv.spec import Footprint, KVSpec, kv_bytes_per_token
from kvbench.engines.sequence import Sequence
from kvbench.errors import KvbenchError
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.workloads.model import Request

Modality = Literal["text", "image", "audio"]
# KVStats fields a decode step can change, and the per-class figures records log by step.
_STEP_FIELDS = ("used_bytes", "reserved_bytes", "free_bytes", "largest_free_bytes",
                "shared_bytes", "block_allocs", "block_frees", "page_table_entries")
_CLASS_FIGURES = ("reserved_bytes", "used_bytes", "capacity_bytes")


def capacity_gain(vision_share: float, text_bytes: float, vision_bytes: float) -> float:
    """How many times the tokens a KV budget holds when a share ``vision_share`` of the
    positions is stored at ``vision_bytes`` per element instead of ``text_bytes``."""
    if not 0.0 <= vision_share <= 1.0:
        raise ValueError(f"vision share must be in [0, 1], got {vision_share}")
    return 1.0 / (1.0 - vision_share * (1.0 - vision_bytes / text_bytes))


def memory_saving(vision_share: float, text_bytes: float, vision_bytes: float) -> float:
    """Fraction of KV bytes saved for the same tokens (1 - 1 / capacity_gain)."""
    return vision_share * (1.0 - vision_bytes / text_bytes)


def vision_share(requests: list[Request]) -> float:
    """Share of the workload's KV positions (prompt and output) that are image or audio."""
    vision = total = 0
    for r in requests:
        vision += sum(s.tokens for s in r.segments if s.kind != "text")
        total += r.prompt_tokens + r.output_tokens
    return vision / total if total else 0.0


class ModalPolicy(Paging, KVPolicy):
    """Text and vision KV in their own page classes (page size, precision), in one shared
    buddy pool or split pools; prefix caching and forks per class."""

    kind: Literal["modal"] = "modal"
    summary = (
        "modality-aware KV: text / vision page classes with their own page size and precision "
        "(int8 | fp8_e4m3 vision KV), one shared buddy pool or split pools, prefix caching "
        "over both classes, fork + copy-on-write per class"
    )
    kv_dtype: dict[Modality, str] = Field(default_factory=dict)
    vision_page_tokens: int | None = Field(default=None, ge=1)
    pools: Literal["shared", "split"] = "shared"
    vision_share: float = Field(default=0.5, gt=0.0, lt=1.0)
    scale_group: int = Field(default=16, ge=1)

    @field_validator("kv_dtype")
    @classmethod
    def _dtypes(cls, value: dict[str, str]) -> dict[str, str]:
        for modality, dtype in value.items():
            if dtype != "auto" and dtype not in KV_DTYPES:
                raise ValueError(
                    f"kv_dtype.{modality} = {dtype!r}: use auto, {', '.join(KV_DTYPES)}"
                )
        # One of image / audio given: the other (same vision class) follows it.
        value = dict(value)
        if "image" in value or "audio" in value:
            value.setdefault("image", value.get("audio", "auto"))
            value.setdefault("audio", value["image"])
        image, audio = value.get("image", "auto"), value.get("audio", "auto")
        if image != audio:
            raise ValueError(
                f"kv_dtype: image ({image}) and audio ({audio}) share the vision page class "
                "and must have one dtype"
            )
        return value

    def label(self) -> str:
        text, vision = self.kv_dtype.get("text", "auto"), self.kv_dtype.get("image", "auto")
        text_page = self.block_size or "bs"
        pages = f"{text_page}/{self.vision_page_tokens or text_page}"
        pools = "shared" if self.pools == "shared" else f"split{self.vision_share:g}"
        return f"modal/{pages}/{text}+{vision}/{pools}"

    def full_precision(self) -> ModalPolicy:
        return self.model_copy(update={"kv_dtype": {}})

    def check(self, config: EngineConfig) -> list[str]:
        if config.preset.latent is not None and config.device.kind != "sim":
            raise KvbenchError(
                "the modal KV policy's page classes hold per-head keys and values; "
                f"{config.preset.name} caches a latent: run it on another policy, or on a "
                "simulated device")
        if config.preset.sliding_window is not None:
            raise KvbenchError(
                f"the modal KV policy attends class by class with key positions, which the "
                f"kernels do not combine with a sliding window; {config.preset.name} has one"
            )
        return []

    def geometry(self, config: EngineConfig) -> ModalGeometry:
        p = config.preset
        model_bpt = kv_bytes_per_token(p, config.device.tp)
        return ModalGeometry.build(
            model_bpt, p.dtype_bytes, p.head_dim, p.dtype,
            config.kv_bytes - self.held_back_bytes(config.kv_bytes), self,
        )

    def footprint(self, config: EngineConfig, request: Request) -> Footprint:
        return self.geometry(config).footprint(request)

    def manager(self, config: EngineConfig) -> ModalKVManager:
        return ModalKVManager(self.geometry(config), config.scheduler.max_model_len,
                              enable_prefix_caching=config.prefix_caching)


@dataclass(frozen=True, slots=True)
class ModalGeometry:
    """The classes of a modal pool over a budget, and its allocator units."""

    classes: tuple[PoolClass, ...]
    model_bytes_per_token: int
    model_dtype: str
    budget_bytes: int
    pools: str
    unit_bytes: int
    # Units of each allocator: one (shared) or one per class (split, class order).
    pool_units: tuple[int, ...]

    @classmethod
    def build(cls, model_bpt: int, dtype_bytes: int, head_dim: int, model_dtype: str,
              budget: int, policy: ModalPolicy) -> ModalGeometry:
        assert policy.block_size is not None, "resolve the section first"
        elements = model_bpt // dtype_bytes  # KV elements per token (layers x 2 x heads x dim)
        scale_units = elements // head_dim
        specs = []
        for name, holds, page in (
            ("text", ("text",), policy.block_size),
            ("vision", ("image", "audio"), policy.vision_page_tokens or policy.block_size),
        ):
            dtype = policy.kv_dtype.get(holds[0], "auto")  # type: ignore[arg-type]
            dtype = model_dtype if dtype == "auto" else dtype
            group = math.gcd(page, policy.scale_group) if dtype in QUANTISED else 1
            specs.append((name, holds, page, dtype, elements * KV_DTYPES[dtype], group))
        page_bytes = [page * bpt for _, _, page, _, bpt, _ in specs]
        unit = min(page_bytes)
        for (name, _, page, dtype, _, _), b in zip(specs, page_bytes, strict=True):
            ratio = b // unit
            if b % unit or ratio & (ratio - 1):
                raise KvbenchError(
                    f"modal KV: the {name} page ({page} tokens of {dtype}, {b} bytes) is not a "
                    f"power-of-two multiple of the smallest page ({unit} bytes); choose page "
                    "sizes whose byte sizes are"
                )

        def table_bytes(units: int) -> list[int]:
            """Scale-table bytes of each class addressing ``units`` units."""
            return [units * unit // bpt // g * scale_units * SCALE_BYTES if d in QUANTISED else 0
                    for _, _, _, d, bpt, g in specs]

        def fit(budget_bytes: int, classes: list[int]) -> int:
            """The most units whose pages and the scale tables of ``classes`` fit."""
            units = budget_bytes // unit
            while units > 0 and units * unit + sum(table_bytes(units)[k] for k in classes) > \
                    budget_bytes:
                over = units * unit + sum(table_bytes(units)[k] for k in classes) - budget_bytes
                units -= max(1, over // unit)
            return max(units, 0)

        if policy.pools == "shared":
            units = fit(budget, [0, 1])
            pool_units: tuple[int, ...] = (units,)
            class_units = [units, units]
        else:
            share = (1.0 - policy.vision_share, policy.vision_share)
            class_units = [fit(int(budget * share[k]), [k]) for k in range(2)]
            pool_units = tuple(class_units)
        classes, base = [], 0
        for k, ((name, holds, page, dtype, bpt, group), units) in enumerate(
                zip(specs, class_units, strict=True)):
            slots = units * unit // bpt
            classes.append(PoolClass(name, holds, page, dtype, bpt, base, slots, group,
                                     scale_units if dtype in QUANTISED else 0,
                                     0 if policy.pools == "shared" else k))
            base += slots
        if min(pool_units) * unit < max(page_bytes):
            raise KvbenchError(
                f"KV budget {budget} bytes holds no page of every class in the modal pool "
                f"({', '.join(f'{c.name}: {c.page_bytes} B' for c in classes)}); raise "
                "--kv-memory"
            )
        return cls(tuple(classes), model_bpt, model_dtype, budget, policy.pools, unit,
                   pool_units)

    @property
    def pool_bytes(self) -> int:
        """Bytes of pages and scale tables the pool really holds."""
        return sum(self.pool_units) * self.unit_bytes + sum(c.scale_bytes for c in self.classes)

    def class_tokens(self, request: Request) -> tuple[int, int]:
        """Text and vision KV positions of ``request``'s one sample at its longest."""
        vision = sum(s.tokens for s in request.segments if s.kind != "text")
        return request.prompt_tokens + request.output_tokens - vision, vision

    def footprint(self, request: Request) -> Footprint:
        counts = self.class_tokens(request)
        # The last sampled token is never stored, but a page bound is a page bound.
        need = [-(-n // c.page_tokens) * c.page_bytes for n, c in zip(counts, self.classes,
                                                                     strict=True)]
        bpt = self.model_bytes_per_token
        if self.pools == "shared":
            need_bytes, cap = sum(need), self.pool_units[0] * self.unit_bytes
            what = " + ".join(f"{b // c.page_bytes} {c.name} pages" for b, c in
                              zip(need, self.classes, strict=True))
            where = f"{cap // self.unit_bytes} units"
        else:
            caps = [u * self.unit_bytes for u in self.pool_units]
            i = max(range(2), key=lambda k: need[k] / caps[k])
            need_bytes, cap = need[i], caps[i]
            c = self.classes[i]
            what = f"{need[i] // c.page_bytes} {c.name} pages of {c.page_tokens} tokens"
            where = f"{cap // c.page_bytes} {c.name} pages"
        return Footprint(-(-need_bytes // bpt), cap // bpt, what, where,
                         "" if self.pools == "shared" else " or the pool split (vision_share)")

    def to_json(self) -> dict[str, Any]:
        return {
            "pools": self.pools, "unit_bytes": self.unit_bytes,
            "pool_units": list(self.pool_units), "budget_bytes": self.budget_bytes,
            "pool_bytes": self.pool_bytes, "classes": [c.to_json() for c in self.classes],
        }


@dataclass(slots=True)
class _ClassPages:
    """A sequence's pages of one class: class-local first slots, in position order."""

    starts: list[int] = field(default_factory=list)
    committed: int = 0  # class tokens written
    indexed: int = 0  # leading pages offered to the prefix cache


@dataclass(slots=True)
class _Positions:
    """Where a sequence's tokens lie (kept across preemption, dropped when it finishes):
    ``vision_before`` ``[n_prompt + 1]`` counts vision positions before each prompt position;
    ``class_pos[k]`` the prompt positions of class ``k`` in order; ``hashes[p]`` the key of
    the prefix ``[0, p]`` (computed as far as needed)."""

    vision_before: np.ndarray
    class_pos: tuple[np.ndarray, np.ndarray]
    hashes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _SeqState:
    vision_before: np.ndarray  # [n_prompt + 1]: vision positions before each prompt position
    pages: tuple[_ClassPages, _ClassPages]
    # Prompt positions, and the vision ones among them: every later position is text.
    prompt: int = field(init=False)
    vision: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt = len(self.vision_before) - 1
        self.vision = int(self.vision_before[-1])


class ModalKVManager(KVManager):
    """Bookkeeping of text and vision page classes (see the module docstring)."""

    kind = "modal"

    def __init__(self, geometry: ModalGeometry, max_model_len: int,
                 enable_prefix_caching: bool = False) -> None:
        self.geometry = geometry
        self.classes = geometry.classes
        self.max_model_len = max_model_len
        bpt = geometry.model_bytes_per_token
        # Capacity in tokens of the model's dtype: capacity_tokens x bytes_per_token is the
        # pool's bytes, as every figure built on the KVManager interface reads it.
        self.spec = KVSpec(self.classes[0].page_tokens, bpt, geometry.model_dtype)
        self.capacity_tokens = geometry.pool_bytes // bpt
        unit = geometry.unit_bytes
        self._orders = [int(math.log2(c.page_bytes // unit)) for c in self.classes]
        top = max(self._orders)
        if geometry.pools == "shared":
            pool = BuddyPool(geometry.pool_units[0], 2, top)
            self._pools = [pool, pool]
        else:
            self._pools = [BuddyPool(u, 2, top) for u in geometry.pool_units]
        self._seqs: dict[int, _SeqState] = {}
        self._used = [0, 0]  # slots written in pages some live sequence holds (each once)
        self._pages = [0, 0]  # pages held by live sequences, per class (each once)
        self._allocs = self._frees = 0
        # Prefix cache: per class, by class-local page id (first slot // page tokens).
        self.enable_prefix_caching = enable_prefix_caching
        pages = [c.num_slots // c.page_tokens for c in self.classes]
        self._ref = [[0] * n for n in pages]
        self._hash: list[list[int | None]] = [[None] * n for n in pages]
        self._hit = [[False] * n for n in pages]
        self._by_hash: list[dict[int, int]] = [{}, {}]
        # Free cached pages, (class, page) least recently freed first, one queue per pool.
        self._lru = [LRUQueue()] if geometry.pools == "shared" else [LRUQueue(), LRUQueue()]
        self._cached_free = [0, 0]  # pages waiting in the LRU queues, per class
        self._shared = [0, 0]  # held pages serving a second request (got from a hit)
        self._evictions = 0
        self._hit_tokens = self._query_tokens = 0
        self._hasher = BlockHasher(1)
        self._positions: dict[int, _Positions] = {}
        self._copies: list[SlotCopy] = []
        self._copied_bytes = 0

    def pool_classes(self) -> tuple[PoolClass, ...]:
        return self.classes

    # Capacity planning -------------------------------------------------------------------

    def footprint(self, request: Request) -> Footprint:
        return self.geometry.footprint(request)

    def held_tokens(self, prompt: int, output: int, n: int = 1) -> int:
        # Without the request's segments the split is unknown: count text pages.
        page = self.classes[0].page_tokens
        return -(-(prompt + n * output) // page) * page

    def lookup_prefix(self, seq: Sequence) -> int:
        if not self.enable_prefix_caching:
            return 0
        return self._hit_length(seq)[0]

    # Positions and classes ---------------------------------------------------------------

    def _state(self, seq: Sequence) -> _SeqState:
        return self._seqs[seq.seq_id]

    @staticmethod
    def _vision_before(seq: Sequence) -> np.ndarray:
        mask = np.zeros(seq.num_prompt_tokens, dtype=np.int64)
        pos = 0
        for s in seq.request.segments:
            if s.kind != "text":
                mask[pos : pos + s.tokens] = 1
            pos += s.tokens
        out = np.zeros(seq.num_prompt_tokens + 1, dtype=np.int64)
        np.cumsum(mask, out=out[1:])
        return out

    @staticmethod
    def _counts(state: _SeqState, end: int) -> tuple[int, int]:
        """Text and vision positions among ``[0, end)``."""
        vision = state.vision if end >= state.prompt else int(state.vision_before[end])
        return end - vision, vision

    def _room(self, state: _SeqState, k: int) -> int:
        return len(state.pages[k].starts) * self.classes[k].page_tokens

    def _take(self, state: _SeqState, end: int) -> bool:
        """Pages so that positions ``[0, end)`` have slots; all or nothing (but pages
        evicted from the prefix cache on the way stay evicted)."""
        need = self._counts(state, end)
        taken: list[tuple[int, int]] = []
        for k, c in enumerate(self.classes):
            pages = -(-need[k] // c.page_tokens) - len(state.pages[k].starts)
            for _ in range(max(pages, 0)):
                start = self._take_unit(k)
                if start is None:
                    for kk, s in reversed(taken):
                        self._pools[kk].give(s, self._orders[kk])
                    return False
                taken.append((k, start))
        unit = self.geometry.unit_bytes
        for k, start in taken:
            c = self.classes[k]
            first = start * unit // c.bytes_per_token
            state.pages[k].starts.append(first)
            self._ref[k][first // c.page_tokens] = 1
            self._pages[k] += 1
        self._allocs += len(taken)
        return True

    def _take_unit(self, k: int) -> int | None:
        """First unit of a free page of class ``k``, evicting free cached pages of its pool
        (least recently freed first) while none is free; None when nothing is left."""
        pool, order = self._pools[k], self._orders[k]
        start = pool.take(order)
        if start is None:
            lru = self._lru[0 if len(self._lru) == 1 else k]
            unit = self.geometry.unit_bytes
            while start is None and lru:
                (kk, page), = lru.evict(1)
                c = self.classes[kk]
                h = self._hash[kk][page]
                assert h is not None
                del self._by_hash[kk][h]
                self._hash[kk][page] = None
                self._cached_free[kk] -= 1
                self._evictions += 1
                self._pools[kk].give(page * c.page_bytes // unit, self._orders[kk])
                start = pool.take(order)
        return start

    # Prefix cache ---------------------------------------------------------------------------

    def _where(self, seq: Sequence) -> _Positions:
        info = self._positions.get(seq.seq_id)
        if info is None:
            vb = self._vision_before(seq)
            is_vision = np.diff(vb).astype(bool)
            info = _Positions(vb, (np.flatnonzero(~is_vision), np.flatnonzero(is_vision)))
            self._positions[seq.seq_id] = info
        return info

    def modality_tokens(self, seqs: list[Sequence]) -> tuple[int, int, int]:
        """Text, image and audio tokens written in the pages live ``seqs`` hold, each page
        once however many sequences share it: the text class holds only text; a vision
        page's audio positions are counted from one of its holders (pages shared through a
        hit or a fork have the same tokens)."""
        pt = self.classes[1].page_tokens
        seen: set[int] = set()
        audio = 0
        for seq in seqs:
            if not any(s.kind == "audio" for s in seq.request.segments):
                continue
            state = self._seqs.get(seq.seq_id)
            info = self._positions.get(seq.seq_id)
            if state is None or info is None:
                continue
            kinds = np.repeat(np.array([s.kind == "audio" for s in seq.request.segments]),
                              [s.tokens for s in seq.request.segments])
            vision = info.class_pos[1]
            pages = state.pages[1]
            for j, start in enumerate(pages.starts):
                page = start // pt
                if page in seen:
                    continue
                seen.add(page)
                audio += int(kinds[vision[j * pt : min((j + 1) * pt, pages.committed)]].sum())
        return self._used[0], self._used[1] - audio, audio

    def _prefix_hashes(self, seq: Sequence, info: _Positions, end: int) -> list[int]:
        """Keys of the prefixes ``[0, p]`` for every ``p < end`` (at least)."""
        hashes = info.hashes
        have = len(hashes)
        if have < end:
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes += self._hasher.chain(parent, seq.token_ids(have, end))
        return hashes

    def _page_end(self, seq: Sequence, info: _Positions, k: int, j: int) -> int:
        """Position of the last token of class ``k``'s page ``j`` (generated tokens, all
        text, follow the prompt)."""
        rank = (j + 1) * self.classes[k].page_tokens - 1
        pos = info.class_pos[k]
        if rank < len(pos):
            return int(pos[rank])
        if k == 0:
            return seq.num_prompt_tokens + rank - len(pos)
        raise AssertionError("a vision rank past the prompt")

    def _page_keys(self, seq: Sequence, info: _Positions, k: int, first: int,
                   end: int) -> list[int]:
        """Keys of class ``k``'s full pages ``first .. end - 1``."""
        if end <= first:
            return []
        last = self._page_end(seq, info, k, end - 1)
        hashes = self._prefix_hashes(seq, info, last + 1)
        return [hashes[self._page_end(seq, info, k, j)] for j in range(first, end)]

    def _hit_length(self, seq: Sequence) -> tuple[int, tuple[int, int]]:
        """The longest cached prefix of ``seq`` (leaving one token to compute) and the pages
        of each class it covers."""
        info = self._where(seq)
        n = seq.num_tokens
        n_prompt = seq.num_prompt_tokens
        vb = info.vision_before
        vision_total = int(vb[-1])
        # Class tokens among the first n - 1 positions: the most a hit may cover.
        counts = (n - 1 - int(vb[min(n - 1, n_prompt)]), int(vb[min(n - 1, n_prompt)]))
        hits = []
        for k, c in enumerate(self.classes):
            full = counts[k] // c.page_tokens
            keys = self._page_keys(seq, info, k, 0, full)
            index, h = self._by_hash[k], 0
            for key in keys:
                if key not in index:
                    break
                h += 1
            hits.append(h)
        # Positions up to the first token of each class that is not in a cached page.
        limit = n - 1
        for k, c in enumerate(self.classes):
            rank = hits[k] * c.page_tokens
            if k == 1 and rank < vision_total:
                limit = min(limit, int(info.class_pos[1][rank]))
            elif k == 0:
                if rank < len(info.class_pos[0]):
                    limit = min(limit, int(info.class_pos[0][rank]))
                else:
                    limit = min(limit, n_prompt + rank - len(info.class_pos[0]))
        # The longest L <= limit at which both classes sit at a page boundary.
        ends = np.arange(limit + 1, dtype=np.int64)
        vision = vb[np.minimum(ends, n_prompt)]
        ok = (vision % self.classes[1].page_tokens == 0) & (
            (ends - vision) % self.classes[0].page_tokens == 0)
        cut = int(np.flatnonzero(ok)[-1])
        v = int(vb[min(cut, n_prompt)])
        return cut, ((cut - v) // self.classes[0].page_tokens, v // self.classes[1].page_tokens)

    def _attach(self, seq: Sequence, state: _SeqState, num_cached: int) -> list[list[int]]:
        """Reference the cached pages covering ``seq``'s first ``num_cached`` tokens."""
        cut, pages = self._hit_length(seq)
        if cut < num_cached:
            raise RuntimeError("prefix lookup is stale: cached pages were evicted since")
        info = self._where(seq)
        counts = self._counts(state, num_cached)
        attached: list[list[int]] = []
        for k, c in enumerate(self.classes):
            if counts[k] % c.page_tokens:
                raise RuntimeError(
                    f"cannot attach {num_cached} cached tokens: they end inside a {c.name} page")
            n = counts[k] // c.page_tokens
            assert n <= pages[k]
            index = self._by_hash[k]
            ids = [index[key] for key in self._page_keys(seq, info, k, 0, n)]
            for page in ids:
                r = self._ref[k][page]
                if r == 0:
                    self._lru[0 if len(self._lru) == 1 else k].remove((k, page))
                    self._cached_free[k] -= 1
                    self._pages[k] += 1
                    self._used[k] += c.page_tokens
                    self._allocs += 1
                if not self._hit[k][page] and r <= 1:
                    self._shared[k] += 1
                self._hit[k][page] = True
                self._ref[k][page] = r + 1
            attached.append(ids)
        return attached

    def _release(self, state: _SeqState) -> None:
        """Drop ``state``'s reference to each of its pages: a page nobody holds goes back to
        its buddy pool, or, holding a cached page, to the LRU queue, the pages of both
        classes by their first position from the tail on (the common prefix, the likeliest
        to be hit again, is evicted last)."""
        unit = self.geometry.unit_bytes
        order = []
        vb = state.vision_before
        n_prompt = len(vb) - 1
        text_before = np.arange(n_prompt + 1) - vb
        for k, c in enumerate(self.classes):
            ranks = np.arange(len(state.pages[k].starts), dtype=np.int64) * c.page_tokens
            before = vb if k else text_before
            first = np.searchsorted(before, ranks + 1) - 1  # position of each page's rank
            if k == 0:  # generated tokens follow the prompt
                past = ranks >= text_before[-1]
                first[past] = n_prompt + ranks[past] - text_before[-1]
            order += [(int(f), k, i) for i, f in enumerate(first.tolist())]
        order.sort(reverse=True)
        for _, k, i in order:
            c = self.classes[k]
            pages, size = state.pages[k], c.page_tokens
            ref, hit = self._ref[k], self._hit[k]
            page = pages.starts[i] // size
            r = ref[page] - 1
            ref[page] = r
            if r:
                if r == 1 and not hit[page]:
                    self._shared[k] -= 1  # forked samples' page, one holder left
                continue
            self._pages[k] -= 1
            self._used[k] -= min(max(pages.committed - i * size, 0), size)
            self._frees += 1
            if hit[page]:
                hit[page] = False
                self._shared[k] -= 1
            if self._hash[k][page] is None:
                self._pools[k].give(page * c.page_bytes // unit, self._orders[k])
            else:
                self._lru[0 if len(self._lru) == 1 else k].add((k, page))
                self._cached_free[k] += 1

    def _index(self, seq: Sequence, state: _SeqState) -> None:
        """Offer ``seq``'s newly full pages to the prefix cache (a key already cached by
        another page keeps that page; this one stays unindexed)."""
        info = None
        for k, c in enumerate(self.classes):
            pages = state.pages[k]
            full = pages.committed // c.page_tokens
            if full <= pages.indexed:
                continue
            info = info or self._where(seq)
            keys = self._page_keys(seq, info, k, pages.indexed, full)
            index, hashes = self._by_hash[k], self._hash[k]
            for j, key in zip(range(pages.indexed, full), keys, strict=True):
                page = pages.starts[j] // c.page_tokens
                if hashes[page] is None and index.setdefault(key, page) == page:
                    hashes[page] = key
            pages.indexed = full

    # The KVManager interface ---------------------------------------------------------------

    def allocate(self, seq: Sequence, num_cached: int, num_new: int) -> bool:
        if seq.seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq.seq_id} is already allocated")
        if num_cached and not self.enable_prefix_caching:
            raise RuntimeError("prefix caching is off: no cached tokens to attach")
        vb = self._where(seq).vision_before if self.enable_prefix_caching else \
            self._vision_before(seq)
        state = _SeqState(vb, (_ClassPages(), _ClassPages()))
        if num_cached:
            attached = self._attach(seq, state, num_cached)
            counts = self._counts(state, num_cached)
            for k, c in enumerate(self.classes):
                pages = state.pages[k]
                pages.starts = [p * c.page_tokens for p in attached[k]]
                pages.committed, pages.indexed = counts[k], len(attached[k])
        if not self._take(state, num_cached + num_new):
            if num_cached:
                self._release(state)
            return False
        self._seqs[seq.seq_id] = state
        if self.enable_prefix_caching:
            self._hit_tokens += num_cached
            self._query_tokens += seq.num_tokens
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        return True

    def grow(self, seq: Sequence, num_new: int) -> bool:
        state = self._state(seq)
        pos = seq.num_computed_tokens
        if num_new == 1 and pos >= state.prompt and self._has_slot(state, pos - state.vision):
            return True  # the common decode step
        # A class's page written next that forked samples share: copied first.
        cow = []
        if num_new > 0:
            before, after = self._counts(state, pos), self._counts(state, pos + num_new)
            for k, c in enumerate(self.classes):
                rank = before[k]
                if after[k] > rank and rank % c.page_tokens:
                    page = state.pages[k].starts[rank // c.page_tokens] // c.page_tokens
                    if self._ref[k][page] > 1:
                        cow.append((k, rank // c.page_tokens))
        if not cow:
            return self._take(state, pos + num_new)
        fresh: list[tuple[int, int]] = []
        for k, _ in cow:
            start = self._take_unit(k)
            if start is None:
                for kk, u in reversed(fresh):
                    self._pools[kk].give(u, self._orders[kk])
                return False
            fresh.append((k, start))
        unit = self.geometry.unit_bytes
        for (k, start), (_, i) in zip(fresh, cow, strict=True):
            c = self.classes[k]
            pages = state.pages[k]
            old, new = pages.starts[i], start * unit // c.bytes_per_token
            self._ref[k][new // c.page_tokens] = 1
            r = self._ref[k][old // c.page_tokens] - 1
            self._ref[k][old // c.page_tokens] = r
            if r == 1 and not self._hit[k][old // c.page_tokens]:
                self._shared[k] -= 1
            pages.starts[i] = new
            self._pages[k] += 1
            self._used[k] += pages.committed - i * c.page_tokens
            self._allocs += 1
            self._copies.append(SlotCopy(src=c.base + old, dst=c.base + new,
                                         num_slots=c.page_tokens))
            self._copied_bytes += c.page_bytes
        # Without room for the rest the copies still stand: the pages are this sample's.
        return self._take(state, pos + num_new)

    def _has_slot(self, state: _SeqState, rank: int) -> bool:
        """Whether text position ``rank`` of the class has a slot that is its own (or starts
        a page, which is never copied)."""
        pt = self.classes[0].page_tokens
        starts = state.pages[0].starts
        return rank < len(starts) * pt and (
            not rank % pt or self._ref[0][starts[rank // pt] // pt] == 1)

    def commit(self, seq: Sequence) -> None:
        state = self._state(seq)
        counts = self._counts(state, seq.num_computed_tokens)
        for k in range(2):
            pages = state.pages[k]
            if counts[k] > self._room(state, k):
                raise RuntimeError(
                    f"sequence {seq.seq_id}: {counts[k]} {self.classes[k].name} tokens computed "
                    f"outside its {self._room(state, k)} slots"
                )
            self._used[k] += counts[k] - pages.committed
            pages.committed = counts[k]
        if self.enable_prefix_caching:
            self._index(seq, state)

    def free(self, seq: Sequence) -> None:
        if seq.is_finished:
            self._positions.pop(seq.seq_id, None)
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            return
        self._release(state)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self._seqs:
            raise RuntimeError(f"sequence {child.seq_id} is already allocated")
        state = self._state(parent)
        pages = []
        for k, c in enumerate(self.classes):
            mine = state.pages[k]
            # Only pages holding computed KV; room reserved beyond stays the parent's.
            shared = mine.starts[: -(-mine.committed // c.page_tokens)]
            ref, hit = self._ref[k], self._hit[k]
            for first in shared:
                page = first // c.page_tokens
                if ref[page] == 1 and not hit[page]:
                    self._shared[k] += 1
                ref[page] += 1
            pages.append(_ClassPages(list(shared), mine.committed,
                                     min(mine.indexed, len(shared))))
        self._seqs[child.seq_id] = _SeqState(state.vision_before, (pages[0], pages[1]))
        info = self._positions.get(parent.seq_id)
        if info is not None:
            self._positions[child.seq_id] = _Positions(info.vision_before, info.class_pos,
                                                       list(info.hashes))

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Flat slots (each class's after its ``base``) of positions ``[start, end)``."""
        state = self._state(seq)
        pos = np.arange(start, end, dtype=np.int64)
        vb = state.vision_before
        n_prompt = len(vb) - 1
        inside = np.minimum(pos, n_prompt)
        vision_rank = vb[inside]
        is_vision = np.zeros(len(pos), dtype=bool)
        in_prompt = pos < n_prompt
        is_vision[in_prompt] = vb[pos[in_prompt] + 1] > vb[pos[in_prompt]]
        out = np.empty(len(pos), dtype=np.int64)
        for k, c in enumerate(self.classes):
            rows = is_vision if k else ~is_vision
            if not rows.any():
                continue
            rank = vision_rank[rows] if k else pos[rows] - vision_rank[rows]
            starts = np.asarray(state.pages[k].starts, dtype=np.int64)
            page = rank // c.page_tokens
            if page.max() >= len(starts):
                raise RuntimeError(
                    f"sequence {seq.seq_id}: positions [{start}, {end}) outside its "
                    f"{c.name} pages"
                )
            out[rows] = c.base + starts[page] + rank % c.page_tokens
        return out

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> ClassTables:
        tables, lens = [], []
        for k, c in enumerate(self.classes):
            counts = np.array([self._counts(self._state(s), int(n))[k]
                               for s, n in zip(seqs, context_lens, strict=True)], dtype=np.int64)
            width = max(1, int(-(-counts.max() // c.page_tokens))) if len(counts) else 1
            table = np.zeros((len(seqs), width), dtype=np.int32)
            for i, s in enumerate(seqs):
                n = -(-int(counts[i]) // c.page_tokens)
                starts = self._state(s).pages[k].starts[:n]
                table[i, :n] = np.asarray(starts, dtype=np.int64) // c.page_tokens
            tables.append(table)
            lens.append(counts)
        return ClassTables(tuple(tables), tuple(lens), self.classes)

    def take_copies(self) -> list[SlotCopy]:
        copies, self._copies = self._copies, []
        return copies

    def class_stats(self) -> dict[str, dict[str, Any]]:
        """Per class: dtype, page size, bytes held in pages and written, and the class's
        capacity (its own pool when split; the shared pool when shared)."""
        out = {}
        for k, c in enumerate(self.classes):
            held = self._pages[k] * c.page_bytes
            cap = self._pools[k].num_units * self.geometry.unit_bytes
            out[c.name] = {
                "dtype": c.dtype, "element_bytes": KV_DTYPES[c.dtype],
                "page_tokens": c.page_tokens,
                "capacity_bytes": cap, "reserved_bytes": held,
                "used_bytes": self._used[k] * c.bytes_per_token,
                "used_tokens": self._used[k], "pages": self._pages[k],
                "scale_bytes": c.scale_bytes,
            }
        return out

    def stats(self) -> KVStats:
        unit = self.geometry.unit_bytes
        pools = self._pools[:1] if self.geometry.pools == "shared" else self._pools
        # Free cached pages are free too (a take evicts them), as in paged.
        free = sum(p.free_units for p in pools) * unit + self._cached_free_bytes()
        if self.geometry.pools == "shared":
            # Free bytes that can still become a page of the largest class: the rest serves
            # only smaller pages (the shared pool's external fragmentation).
            top = max(self._orders)
            pool = pools[0]
            largest = sum(pool.free_pages(k) * pool.sizes[k]
                          for k in range(top, pool.top + 1)) * unit
        else:
            # Each pool's pages are of one class, every free page serves it.
            largest = max(p.free_units for p in pools) * unit
        held = sum(n * c.page_bytes for n, c in zip(self._pages, self.classes, strict=True))
        used = sum(n * c.bytes_per_token for n, c in zip(self._used, self.classes, strict=True))
        # Scale tables are a fixed part of the capacity, held from the start: not reserved
        # by sequences, so waste and utilisation count pages only.
        return KVStats(
            capacity_bytes=self.geometry.pool_bytes,
            used_bytes=used,
            reserved_bytes=held,
            free_bytes=free,
            largest_free_bytes=largest,
            shared_bytes=sum(n * c.page_bytes for n, c in zip(self._shared, self.classes,
                                                              strict=True)),
            prefix_hit_tokens=self._hit_tokens if self.enable_prefix_caching else None,
            prefix_query_tokens=self._query_tokens if self.enable_prefix_caching else None,
            evictions=self._evictions if self.enable_prefix_caching else None,
            block_allocs=self._allocs,
            block_frees=self._frees,
            copied_bytes=self._copied_bytes,
            page_table_entries=sum(self._pages),
            splits=sum(p.splits for p in pools),
            merges=sum(p.coalesces for p in pools),
            classes=self.class_stats(),
        )

    # --- decode fast-forward ---------------------------------------------------------------

    def decode_room(self, seqs: list[Sequence], max_steps: int, keep_cached: bool = False) -> int:
        """Steps before a grow could fail or copy: decoded tokens are text, and the text
        pages the sequences take at page boundaries come from the text pool's free pages (a
        page of a larger free block splits off it) or, unless ``keep_cached``, from its
        cached free text pages (evicting one frees at least one text page; cached vision
        pages evicted on the way only add to that). A shared page being written is an event
        of its own."""
        if self._copies:
            return 0
        pt = self.classes[0].page_tokens
        firsts = []
        for seq in seqs:
            state = self._seqs[seq.seq_id]
            pages, rank = state.pages[0], seq.num_computed_tokens - state.vision
            if seq.num_computed_tokens < state.prompt or pages.committed != rank or (
                    self.enable_prefix_caching and pages.indexed != rank // pt):
                return 0
            left = len(pages.starts) * pt - rank
            if left > 0 and not self._has_slot(state, rank):
                return 0
            firsts.append(left)
        pool, order = self._pools[0], self._orders[0]
        free = sum(pool.free_pages(k) << (k - order) for k in range(order, pool.top + 1))
        if not keep_cached:
            free += self._cached_free[0]
        return steps_within(firsts, pt, max_steps, free)

    def advance_decode(self, seqs: list[Sequence], steps: int) -> dict[str, np.ndarray]:
        """``steps`` decode steps: at each step where a sequence crosses into a new text
        page (a take, in running order) or fills one (prefix-cache entries, after every
        take, as commits follow grows), the state and stats as a step leaves them; between
        those only the written text grows (``class:<name>_<figure>``: a class's bytes)."""
        pt, n, text = self.classes[0].page_tokens, len(seqs), self.classes[0]
        states = [self._seqs[s.seq_id] for s in seqs]
        ranks = [s.num_computed_tokens - st.vision for s, st in zip(seqs, states, strict=True)]
        takes: dict[int, list[int]] = {}
        fills: dict[int, list[int]] = {}
        for i, (state, rank) in enumerate(zip(states, ranks, strict=True)):
            for j in range(len(state.pages[0].starts) * pt - rank, steps, pt):
                takes.setdefault(j, []).append(i)
            if self.enable_prefix_caching:
                for j in range((-(rank + 1)) % pt, steps, pt):
                    fills.setdefault(j, []).append(i)
        used = self._used[0]
        events, snaps = [-1], [self.stats()]
        for j in sorted(takes.keys() | fills.keys()):
            for i in takes.get(j, ()):
                if not self._take(states[i], seqs[i].num_computed_tokens + j + 1):
                    raise RuntimeError(f"sequence {seqs[i].seq_id}: no room within decode_room")
            for i in fills.get(j, ()):
                states[i].pages[0].committed = ranks[i] + j + 1
                self._index(seqs[i], states[i])
            self._used[0] = used + n * (j + 1)
            events.append(j)
            snaps.append(self.stats())
        for state, rank in zip(states, ranks, strict=True):
            state.pages[0].committed = rank + steps
        self._used[0] = used + n * steps
        # Each step reads the stats of the last event at or before it, its text grown since.
        at = np.searchsorted(np.array(events), np.arange(steps), side="right") - 1
        grown = n * (np.arange(steps) - np.array(events)[at]) * text.bytes_per_token
        columns = {name: np.array([getattr(s, name) for s in snaps], dtype=np.int64)[at]
                   for name in _STEP_FIELDS}
        columns["used_bytes"] += grown
        for c in self.classes:
            for figure in _CLASS_FIGURES:
                columns[f"class:{c.name}_{figure}"] = np.array(
                    [s.classes[c.name][figure] for s in snaps], dtype=np.int64)[at]
        columns[f"class:{text.name}_used_bytes"] += grown
        return columns

    def _cached_free_bytes(self) -> int:
        """Bytes of the free pages still holding cached KV (an eviction frees them)."""
        return sum(n * c.page_bytes for n, c in zip(self._cached_free, self.classes,
                                                    strict=True))

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "max_model_len": self.max_model_len,
            "bytes_per_token": self.bytes_per_token,
            "enable_prefix_caching": self.enable_prefix_caching, **self.geometry.to_json(),
        }
