"""A server's replies read as untrusted input: server-sent events split whichever way the
server ends its lines, each chunk's JSON checked field by field, bodies read up to a cap.
Whatever breaks the protocol raises :class:`BadReply`, which fails only its own request.

Counting follows ``vllm bench serve``: a choice's token ids where the server returns them,
else one token per chunk with output (completions text or chat delta content).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

# One event's data, an unterminated line included: far above any chunk of token ids.
MAX_EVENT_BYTES = 1 << 20
# Of an error reply only the start is kept; the rest is never read.
ERROR_BODY_BYTES = 64 << 10
# Integers above this are no token counts (and would overflow the record's columns).
MAX_COUNT = 1 << 53
MAX_TOKEN_ID = 1 << 32
_SHOWN_CHARS = 60
_EOL = re.compile(rb"\r\n|\r|\n")


class BadReply(Exception):
    """A reply that fails its request; the message is the reason recorded."""


def _bad(what: str) -> BadReply:
    return BadReply(f"bad reply: {what}")


@dataclass(frozen=True, slots=True)
class Ask:
    """What a request asked for: ``samples`` choices of exactly ``tokens`` tokens each."""

    samples: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Usage:
    """The server's own counts (None where it does not say)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


@dataclass(frozen=True, slots=True)
class Tokens:
    """Tokens of one choice (sample ``index``) in one chunk."""

    index: int
    count: int
    ids: list[int] | None


class SseReader:
    """Splits a byte stream into the data of its server-sent events. Lines end in CRLF, LF
    or CR, as the SSE format allows; an event or line longer than the cap fails the reply
    rather than growing without bound."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._pending = b""
        self._data: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._pending + chunk
        # A final CR may be the first half of a CRLF: it waits for the next read.
        held = b"\r" if buf.endswith(b"\r") else b""
        lines = _EOL.split(buf[: len(buf) - len(held)])
        self._pending = lines.pop() + held
        if len(self._pending) > self._max:
            raise _bad(f"a stream line longer than {self._max} bytes")
        return self._lines(lines)

    def finish(self) -> list[bytes]:
        """The events the stream's end completes (a last line without its blank line)."""
        lines = _EOL.split(self._pending)
        self._pending = b""
        return self._lines([*lines, b""])

    def _lines(self, lines: list[bytes]) -> list[bytes]:
        events = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                self._data, self._size = [], 0
            elif line.startswith(b"data:"):
                value = line[5:]
                value = value[1:] if value.startswith(b" ") else value
                self._size += len(value)
                if self._size > self._max:
                    raise _bad(f"a stream event longer than {self._max} bytes")
                self._data.append(value)
            # Comments (":...") and the other fields (event, id, retry) carry no tokens.
        return events


class Reply:
    """One streamed completion as it arrives: tokens per sample, the server's usage, and
    whether ``[DONE]`` came. A sample streaming more tokens than asked for fails at once."""

    def __init__(self, ask: Ask) -> None:
        self.ask = ask
        self.counts = [0] * ask.samples
        self.usage: Usage | None = None
        self.done = False

    def take(self, data: bytes) -> list[Tokens]:
        """The tokens one event carries (none for usage-only chunks and ``[DONE]``)."""
        if data.strip() == b"[DONE]":
            self.done = True
            return []
        obj = _json_object(data)
        if obj.get("error"):
            raise BadReply(f"error event: {_error_text(obj['error'])}")
        usage = parse_usage(obj.get("usage"))
        self.usage = usage or self.usage
        choices = obj.get("choices")
        if choices is None:
            return []
        if not isinstance(choices, list):
            raise _bad(f"choices is {_kind(choices)}, not a list")
        out = []
        for choice in choices:
            tokens = parse_choice(choice, self.ask.samples)
            self.counts[tokens.index] += tokens.count
            if self.counts[tokens.index] > self.ask.tokens:
                raise _bad(f"sample {tokens.index} streamed more than the {self.ask.tokens} "
                           "tokens asked for (max_tokens with ignore_eos)")
            if tokens.count:
                out.append(tokens)
        return out


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _bad(f"a chunk is not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise _bad(f"a chunk is {_kind(obj)}, not a JSON object")
    return obj


def parse_choice(choice: Any, samples: int) -> Tokens:
    """The tokens of one streamed choice of a request for ``samples`` choices."""
    if not isinstance(choice, dict):
        raise _bad(f"a choice is {_kind(choice)}, not an object")
    index = choice.get("index", 0)
    if not is_count(index) or index >= samples:
        raise _bad(f"choice index {_show(index)} is not one of the {samples} samples asked for")
    ids = choice.get("token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
                is_count(i) and i < MAX_TOKEN_ID for i in ids):
            raise _bad(f"token_ids is not a list of token ids: {_show(ids)}")
        return Tokens(index, len(ids), ids)
    delta = choice.get("delta")
    if delta is not None:  # chat: the first chunk may carry only the role
        if not isinstance(delta, dict):
            raise _bad(f"delta is {_kind(delta)}, not an object")
        return Tokens(index, _has_text(delta.get("content"), "delta.content"), None)
    return Tokens(index, _has_text(choice.get("text"), "text"), None)


def _has_text(value: Any, name: str) -> int:
    if value is not None and not isinstance(value, str):
        raise _bad(f"{name} is {_kind(value)}, not a string")
    return 1 if value else 0


def parse_usage(usage: Any) -> Usage | None:
    """A chunk's ``usage``, each count a non-negative integer or absent."""
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise _bad(f"usage is {_kind(usage)}, not an object")
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        raise _bad(f"usage.prompt_tokens_details is {_kind(details)}, not an object")
    prompt = _count(usage, "prompt_tokens")
    cached = _count(details or {}, "cached_tokens", "prompt_tokens_details.")
    if cached is not None and prompt is not None and cached > prompt:
        raise _bad(f"usage has {cached} cached of {prompt} prompt tokens")
    return Usage(prompt, _count(usage, "completion_tokens"), cached)


def _count(obj: dict[str, Any], name: str, prefix: str = "") -> int | None:
    value = obj.get(name)
    if value is not None and not is_count(value):
        raise _bad(f"usage.{prefix}{name} is {_show(value)}, not a token count")
    return value


def is_count(value: Any, limit: int = MAX_COUNT) -> bool:
    """A non-negative integer up to ``limit`` (JSON's true and false are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def _error_text(error: Any) -> str:
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(error)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


async def read_head(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most ``limit`` bytes of ``resp``'s body; the rest is never read."""
    out = bytearray()
    while len(out) < limit:
        data = await resp.content.read(limit - len(out))
        if not data:
            break
        out += data
    return bytes(out)


async def read_body(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """``resp``'s whole body, refused when it is over ``limit`` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        raise _bad(f"the body of {resp.content_length} bytes is over the {limit} bytes read")
    data = await read_head(resp, limit + 1)
    if len(data) > limit:
        raise _bad(f"the body is over the {limit} bytes read")
    return data
