"""Event replay of built-in engines on simulated devices (:mod:`.engine`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvbench.engines.kv.base import KVManager, overrides
from kvbench.engines.kv.contiguous import ContiguousKVManager
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.replay.block import COLUMNS, KV_FIELDS, Arrivals, StepBlock
from kvbench.engines.sim.replay.contiguous import ContiguousBook
from kvbench.engines.sim.replay.engine import EventReplay
from kvbench.engines.sim.replay.paged import PagedBook
from kvbench.workloads.model import Request

if TYPE_CHECKING:
    from kvbench.engines.builtin.engine import BuiltinEngine

__all__ = ["COLUMNS", "KV_FIELDS", "Arrivals", "EventReplay", "StepBlock", "event_replay",
           "replay_blocker"]


def replay_blocker(engine: BuiltinEngine, requests: Iterable[Request]) -> str | None:
    """Why ``engine``, whose decode steps can jump (its ``fast_forward_blocker`` is None: a
    simulated device, KV preallocated), cannot be replayed by events over ``requests``
    (None: it can)."""
    reason = _book_blocker(engine.kv)
    if reason is not None:
        return reason
    config = engine.scheduler.config
    if config.max_num_batched_tokens <= config.max_num_seqs:
        return "the token budget may not cover every running sequence's decode"
    for r in requests:
        if r.n != 1:
            return "parallel samples (n > 1)"
        if any(s.kind != "text" for s in r.segments):
            return "image or audio segments"
    return None


def _book_blocker(kv: KVManager) -> str | None:
    """Why the replay's books cannot keep ``kv``'s bookkeeping: they mirror every method of
    :class:`PagedKVManager` and :class:`ContiguousKVManager`, so a subclass that overrides one
    (its constructor and description aside) runs step by step."""
    cls = type(kv)
    base = next((b for b in _MIRRORED if isinstance(kv, b)), None)
    if base is None:
        return f"the {cls.__name__} policy"
    changed = overrides(cls, base, (n for n in dir(base) if not n.startswith("__")
                                    and callable(getattr(base, n)) and n not in _OWN))
    if changed:
        return f"the {cls.__name__} policy overrides {', '.join(changed)} of {base.__name__}"
    if isinstance(kv, PagedKVManager) and kv.sliding_window is not None:
        return "blocks outside the sliding window are released as sequences advance"
    return None


# The managers whose bookkeeping the replay's books keep, and the methods a subclass of one
# may override and still be replayed (they decide nothing a step does).
_MIRRORED = (PagedKVManager, ContiguousKVManager)
_OWN = ("describe",)


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
