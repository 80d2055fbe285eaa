"""Building millions of requests quickly, for the generator and the trace importers.

``Segment`` and ``Request`` are frozen dataclasses, whose generated ``__init__`` sets every
field through ``object.__setattr__``; that is over twice the cost of setting the slots
directly, and it dominated generating a million requests. ``new_segment`` and ``new_request``
fill the same slots directly, all fields given, so what they build is the same frozen object:
equal to, and hashing like, one built by the constructor.

``collector_paused`` stops CPython's cyclic garbage collector while a workload is built: the
objects hold no reference cycles, yet the collector would rescan the growing heap again and
again (a third of the build time at a million requests).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from kvbench.workloads.model import Request, Segment

_new = object.__new__
# Slot setters in field order (a slotted dataclass lists its slots in field order); the
# tests check that these build objects equal to the constructor's.
_SEGMENT_SLOTS = tuple(getattr(Segment, name).__set__ for name in Segment.__slots__)
_REQUEST_SLOTS = tuple(getattr(Request, name).__set__ for name in Request.__slots__)


def new_segment(
    kind: str,
    tokens: int,
    key: str,
    height: int | None,
    width: int | None,
    seconds: float | None,
    rule: str | None,
) -> Segment:
    """``Segment(kind, tokens, key, height, width, seconds, rule)``, built directly."""
    s = _new(Segment)
    set_kind, set_tokens, set_key, set_height, set_width, set_seconds, set_rule = _SEGMENT_SLOTS
    set_kind(s, kind)
    set_tokens(s, tokens)
    set_key(s, key)
    set_height(s, height)
    set_width(s, width)
    set_seconds(s, seconds)
    set_rule(s, rule)
    return s


def text_segment(tokens: int, key: str) -> Segment:
    """``Segment("text", tokens, key)``, built directly."""
    s = _new(Segment)
    set_kind, set_tokens, set_key, set_height, set_width, set_seconds, set_rule = _SEGMENT_SLOTS
    set_kind(s, "text")
    set_tokens(s, tokens)
    set_key(s, key)
    set_height(s, None)
    set_width(s, None)
    set_seconds(s, None)
    set_rule(s, None)
    return s


def new_request(
    id: str,
    arrival_s: float,
    segments: tuple[Segment, ...],
    output_tokens: int,
    prefix_group: str | None,
    session_id: str | None,
    n: int,
) -> Request:
    """``Request(id, arrival_s, segments, output_tokens, prefix_group, session_id, n)``,
    its prompt length summed as the constructor sums it."""
    r = _new(Request)
    (set_id, set_arrival, set_segments, set_output, set_group, set_session, set_n,
     set_prompt) = _REQUEST_SLOTS
    set_id(r, id)
    set_arrival(r, arrival_s)
    set_segments(r, segments)
    set_output(r, output_tokens)
    set_group(r, prefix_group)
    set_session(r, session_id)
    set_n(r, n)
    set_prompt(r, sum(s.tokens for s in segments))
    return r


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while the block runs (as it was, after)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
