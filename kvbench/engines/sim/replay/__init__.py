"""Event replay of built-in engines on simulated devices (:mod:`.engine`)."""

from __future__ import annotations

from collections.abc import Iterable

from kvbench.engines.builtin.engine import BuiltinEngine
from kvbench.engines.builtin.sim_executor import SimExecutor
from kvbench.engines.kv.contiguous import ContiguousKVManager
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.replay.block import COLUMNS, KV_FIELDS, Arrivals, StepBlock
from kvbench.engines.sim.replay.contiguous import ContiguousBook
from kvbench.engines.sim.replay.engine import EventReplay
from kvbench.engines.sim.replay.paged import PagedBook
from kvbench.workloads.model import Request

__all__ = ["COLUMNS", "KV_FIELDS", "Arrivals", "EventReplay", "StepBlock", "event_replay",
           "replay_blocker"]


def replay_blocker(engine: object, requests: Iterable[Request]) -> str | None:
    """Why ``engine`` cannot be replayed by events over ``requests`` (None: it can)."""
    if not isinstance(engine, BuiltinEngine):
        return "not a built-in engine"
    executor = engine.executor
    if not isinstance(executor, SimExecutor):
        return "real compute runs every step"
    if executor.memory.on_demand:
        return "on-demand KV tensors grow every step"
    kv = engine.kv
    if type(kv) is PagedKVManager:
        if kv.sliding_window is not None:
            return "blocks outside the sliding window are released as sequences advance"
        if kv.leak_finished:
            return "finished sequences' blocks leak"
        if kv.eviction != "lru":
            return f"{kv.eviction} eviction of cached blocks"
    elif type(kv) is not ContiguousKVManager:
        return f"the {type(kv).__name__} policy"
    config = engine.scheduler.config
    if config.max_num_batched_tokens <= config.max_num_seqs:
        return "the token budget may not cover every running sequence's decode"
    for r in requests:
        if r.n != 1:
            return "parallel samples (n > 1)"
        if any(s.kind != "text" for s in r.segments):
            return "image or audio segments"
    return None


def event_replay(engine: BuiltinEngine, cost: CostModel, requests: list[Request],
                 waves: int = 1) -> EventReplay:
    """The event replay of ``engine`` (see :func:`replay_blocker`), timed by ``cost``, for
    ``requests`` sent ``waves`` times."""
    kv = engine.kv
    book: PagedBook | ContiguousBook
    shared: set[str] | None = None
    if isinstance(kv, PagedKVManager):
        book = PagedBook(kv, engine.preset.vocab_size)
        if kv.enable_prefix_caching and waves == 1:
            shared = shared_starts(requests, kv.block_size)
    else:
        assert isinstance(kv, ContiguousKVManager)
        book = ContiguousBook(kv)
    return EventReplay(engine, cost, book, shared)


def shared_starts(requests: list[Request], block_size: int) -> set[str]:
    """The contents (segment keys) more than one of ``requests`` starts with, over at least
    a block: only such requests can share prompt blocks (another start gives other tokens
    from the first block on, and blocks are keyed by all tokens up to their end). A prompt
    whose first segment holds less than a block counts as shared."""
    seen: set[str] = set()
    shared: set[str] = set()
    for r in requests:
        first = r.segments[0]
        key = first.key if first.tokens >= block_size else ""
        if key in seen:
            shared.add(key)
        seen.add(key)
    shared.add("")
    return shared
