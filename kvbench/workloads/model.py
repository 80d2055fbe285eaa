"""The request model shared by every engine.

A prompt is a list of segments. Each segment has a ``key`` naming its content: two segments
with the same key hold the same token ids (over their common length). Token ids are derived
from the key by a counter-based hash, so shared prefixes, Mooncake ``hash_ids`` blocks and
multi-turn contexts really share ids (prefix caching and vLLM token-id prompts need that)
without storing millions of ids in the workload file.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from json.encoder import encode_basestring_ascii
from typing import Any, Literal

import numpy as np

SegmentKind = Literal["text", "image", "audio"]
SEGMENT_KINDS: tuple[str, ...] = ("text", "image", "audio")
_SEGMENT_OPTIONAL = ("height", "width", "seconds", "rule")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@lru_cache(maxsize=1 << 16)
def key_hash(key: str) -> int:
    """Stable 64-bit hash of a content key (cached: shared prefixes repeat their keys)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element, in place (a prompt of 100k tokens makes no copies)."""
    with np.errstate(over="ignore"):
        x += _GOLDEN
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
        return x


def segment_token_ids(key: str, n: int, vocab_size: int, start: int = 0) -> np.ndarray:
    """Token ids ``[start, start+n)`` of the content named ``key``, each in ``[0, vocab_size)``."""
    return contents_token_ids([key_hash(key)], [n], vocab_size, start)


def contents_token_ids(contents: Sequence[int] | np.ndarray, counts: list[int],
                       vocab_size: int, start: int = 0) -> np.ndarray:
    """Token ids of consecutive runs, one after another: run ``i`` holds positions
    ``[start, start+counts[i])`` of the content whose key's :func:`key_hash` is
    ``contents[i]``, all in one pass over the whole prompt."""
    total = sum(counts)
    x = np.arange(total, dtype=np.uint64)
    if len(counts) > 1:
        # Position within its own run: subtract each run's offset in the flat array.
        ends = np.cumsum(counts)
        x -= np.repeat((ends - counts).astype(np.uint64), counts)
    with np.errstate(over="ignore"):
        if start:
            x += np.uint64(start)
        x *= _GOLDEN
        x += np.repeat(np.array(contents, dtype=np.uint64), counts)
    x = _splitmix64(x)
    x %= np.uint64(vocab_size)
    return x.astype(np.int64)


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of prompt tokens of one modality.

    ``tokens`` is the number of KV positions the segment occupies. Source facts stay with it:
    image ``height``/``width`` in pixels and the token ``rule`` that gave the count; audio
    ``seconds``.
    """

    kind: SegmentKind
    tokens: int
    key: str
    height: int | None = None
    width: int | None = None
    seconds: float | None = None
    rule: str | None = None

    def to_json(self) -> dict[str, Any]:
        # Field by field: dataclasses.asdict deep-copies and dominated digest time on traces.
        out: dict[str, Any] = {"kind": self.kind, "tokens": self.tokens, "key": self.key}
        for name in _SEGMENT_OPTIONAL:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request. Generation is forced to exactly ``output_tokens`` per sample."""

    id: str
    arrival_s: float
    segments: tuple[Segment, ...]
    output_tokens: int
    prefix_group: str | None = None
    session_id: str | None = None
    n: int = 1
    # Their sum, read at every admission and reservation (a trace prompt has tens of segments).
    prompt_tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", sum(s.tokens for s in self.segments))

    def tokens_of(self, kind: str) -> int:
        return sum(s.tokens for s in self.segments if s.kind == kind)

    def prompt_token_ids(self, vocab_size: int) -> np.ndarray:
        """All prompt token ids (int64); image/audio positions get placeholder ids from the key."""
        segments = self.segments
        return contents_token_ids([key_hash(s.key) for s in segments],
                                  [s.tokens for s in segments], vocab_size)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "arrival_s": self.arrival_s,
            "segments": [s.to_json() for s in self.segments],
            "output_tokens": self.output_tokens,
        }
        if self.prefix_group is not None:
            out["prefix_group"] = self.prefix_group
        if self.session_id is not None:
            out["session_id"] = self.session_id
        if self.n != 1:
            out["n"] = self.n
        return out


@dataclass(slots=True)
class Workload:
    """An ordered list of requests plus what produced them.

    ``spec`` is the JSON-able generator spec or import description, ``source`` a short
    human label (preset name or trace path). ``warnings`` are what the importer or loader
    noticed and the caller should print (e.g. fewer requests than asked for); they are not
    saved with the workload and not part of its digest.
    """

    name: str
    requests: list[Request]
    seed: int
    spec: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    warnings: list[str] = field(default_factory=list)
    # (the request list, its length, its digest) as last computed; requests are frozen, so
    # the digest holds while the same list keeps the same length.
    _digest: tuple[list[Request], int, str] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def digest(self) -> str:
        """Content digest over the requests (order, arrivals, segments, lengths), computed
        once for a request list (a million requests take seconds to hash).

        It hashes, per request, ``json.dumps(r.to_json(), sort_keys=True, separators=(",",
        ":"))`` and a newline, written out by ``_request_json`` without building the dicts.
        """
        cached = self._digest
        if cached is not None and cached[0] is self.requests and cached[1] == len(self.requests):
            return cached[2]
        digest = self._compute_digest()
        self._digest = (self.requests, len(self.requests), digest)
        return digest

    def _compute_digest(self) -> str:
        h = hashlib.sha256()
        segment_json = _SegmentJson()
        for r in self.requests:
            h.update(_request_json(r, segment_json).encode())
        return h.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.requests)


def _json_value(value: object) -> str:
    """``json.dumps(value)``, fast for the str, int and float values requests hold."""
    t = type(value)
    if t is str:
        return encode_basestring_ascii(value)  # type: ignore[arg-type]
    if t is int or (t is float and math.isfinite(value)):  # type: ignore[arg-type]
        return repr(value)
    return json.dumps(value)


def _segment_json(s: Segment) -> str:
    """``json.dumps(s.to_json(), sort_keys=True, separators=(",", ":"))``."""
    head = f'"key":{_json_value(s.key)},"kind":{_json_value(s.kind)}'
    tokens = f'"tokens":{_json_value(s.tokens)}'
    if s.height is None and s.width is None and s.rule is None and s.seconds is None:
        return "{" + head + "," + tokens + "}"
    parts = []
    if s.height is not None:
        parts.append(f'"height":{_json_value(s.height)}')
    parts.append(head)
    if s.rule is not None:
        parts.append(f'"rule":{_json_value(s.rule)}')
    if s.seconds is not None:
        parts.append(f'"seconds":{_json_value(s.seconds)}')
    parts.append(tokens)
    if s.width is not None:
        parts.append(f'"width":{_json_value(s.width)}')
    return "{" + ",".join(parts) + "}"


class _SegmentJson:
    """Segment JSON remembered by identity for the segments seen last.

    Multi-turn prompts repeat the whole conversation, so the same Segment objects come back
    in every later turn of a session. Forgetting everything at the bound keeps memory flat on
    large workloads (turns of a session arrive close together). Keys are ``id()``s of
    segments the workload holds, so they cannot be reused while it is hashed.
    """

    _LIMIT = 1 << 16

    def __init__(self) -> None:
        self._seen: dict[int, str] = {}

    def __call__(self, s: Segment) -> str:
        text = self._seen.get(id(s))
        if text is None:
            text = _segment_json(s)
            if len(self._seen) >= self._LIMIT:
                self._seen.clear()
            self._seen[id(s)] = text
        return text


def _request_json(r: Request, segment_json: _SegmentJson) -> str:
    """``json.dumps(r.to_json(), sort_keys=True, separators=(",", ":"))`` plus a newline."""
    segments = ",".join(map(segment_json, r.segments))
    head = f'{{"arrival_s":{_json_value(r.arrival_s)},"id":{_json_value(r.id)}'
    output = f'"output_tokens":{_json_value(r.output_tokens)}'
    if r.n == 1 and r.prefix_group is None and r.session_id is None:
        return f"{head},{output},\"segments\":[{segments}]}}\n"
    parts = [head]
    if r.n != 1:
        parts.append(f'"n":{_json_value(r.n)}')
    parts.append(output)
    if r.prefix_group is not None:
        parts.append(f'"prefix_group":{_json_value(r.prefix_group)}')
    parts.append(f'"segments":[{segments}]')
    if r.session_id is not None:
        parts.append(f'"session_id":{_json_value(r.session_id)}')
    return ",".join(parts) + "}\n"
