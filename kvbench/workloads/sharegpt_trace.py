"""ShareGPT JSON: a list of ``{"conversations": [{"from", "value"}, ...]}``.

The first human turn is the prompt, the first model turn after it the output. With no
tokenizer offline, lengths are estimated as ``ceil(characters / 4)`` tokens (at least 1),
the usual rule of thumb for English BPE vocabularies. Conversations without such a pair are
skipped (counted in the workload spec). ShareGPT has no timestamps: every request arrives at
0 s.

The file is one JSON array, parsed a conversation at a time as it is read and only as far as
the requests asked for, so a file of any size needs the memory of one conversation; one
longer than ``MAX_ITEM_CHARS`` (64 Mi characters) is refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError
from kvbench.workloads.bulk import collector_paused, new_request, text_segment
from kvbench.workloads.model import Request
from kvbench.workloads.textstream import CHUNK_BYTES, TextStream, too_deep
from kvbench.workloads.trace_rows import TraceRead, check_lengths

SHAREGPT_CHARS_PER_TOKEN = 4
_PROMPT_ROLES = frozenset({"human", "user"})
_ANSWER_ROLES = frozenset({"gpt", "chatgpt", "assistant"})
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
# The longest conversation read: ShareGPT's run to some hundred kB, so this is a file that
# is not ShareGPT (or an array never closed), refused before it fills memory.
MAX_ITEM_CHARS = 64 << 20


class _ArrayItems:
    """The items of a top-level JSON array read from a stream, each with the line it starts
    on. The text is held from the current item on, so memory is bounded by the largest item
    (at most ``MAX_ITEM_CHARS``) and a chunk, not by the file."""

    def __init__(self, stream: TextStream) -> None:
        self.path = stream.path
        self._chunks = stream.chunks()
        self._text = ""
        self._pos = 0
        self._line = 1  # the line at self._pos
        self._eof = False

    def _more(self, at_least: int = 1) -> bool:
        """Append at least ``at_least`` characters (fewer at the end of the file); False
        when there was nothing left. The text before the current position is dropped."""
        parts = [self._text[self._pos:]]
        got = 0
        while got < at_least and not self._eof:
            chunk = next(self._chunks, None)
            if chunk is None:
                self._eof = True
            else:
                parts.append(chunk)
                got += len(chunk)
        self._text, self._pos = "".join(parts), 0
        return got > 0

    def _advance(self, to: int) -> None:
        self._line += self._text.count("\n", self._pos, to)
        self._pos = to

    def _next_char(self) -> str:
        """The next character that is not JSON whitespace ("" at the end of the file)."""
        while True:
            self._advance(_WS.match(self._text, self._pos).end())
            if self._pos < len(self._text) or not self._more():
                return self._text[self._pos : self._pos + 1]

    def _cut_short(self, e: json.JSONDecodeError) -> bool:
        """Whether ``e`` may only mean that the value goes on past the text read so far:
        a string left open, or an error within its last few characters (a number, literal
        or \\uXXXX escape cut by the chunk's end)."""
        return e.msg.startswith("Unterminated string") or e.pos >= len(self._text) - 8

    def _decode(self) -> Any:
        """The JSON value at the current position, reading on until it is whole."""
        while True:
            try:
                item, end = _DECODER.raw_decode(self._text, self._pos)
                # A value that ends the text read so far may go on (a number's digits).
                if end < len(self._text) or self._eof:
                    self._advance(end)
                    return item
            except json.JSONDecodeError as e:
                if self._eof or not self._cut_short(e):
                    line = self._line + self._text.count("\n", self._pos, e.pos)
                    raise InputFileError(self.path, f"not valid JSON: {e.msg}", line) from None
            except RecursionError:
                raise too_deep(self.path, "ShareGPT file", self._line) from None
            held = len(self._text) - self._pos
            if held > MAX_ITEM_CHARS:
                raise InputFileError(
                    self.path, f"a conversation longer than {MAX_ITEM_CHARS >> 20} Mi "
                    "characters, or one never closed: not a ShareGPT file", self._line,
                )
            # Doubling, so each item is parsed a few times at most; never far past the cap.
            self._more(max(CHUNK_BYTES, min(held, MAX_ITEM_CHARS + 1 - held)))

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self._next_char() != "[":
            raise InputFileError(self.path, "expected a JSON array of conversations", 1)
        self._advance(self._pos + 1)
        if self._next_char() == "]":
            return
        while True:
            line = self._line
            yield line, self._decode()
            sep = self._next_char()
            if sep == "]":
                return
            if sep != ",":
                raise InputFileError(
                    self.path, "expected ',' or ']' after a conversation", self._line
                )
            self._advance(self._pos + 1)
            self._next_char()


def _tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / SHAREGPT_CHARS_PER_TOKEN))


def _pair(item: Any, path: Path, line: int) -> tuple[str, str] | None:
    """(prompt text, answer text) of a conversation, or None when it has no such pair."""
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        raise InputFileError(path, "each entry needs a 'conversations' list", line)
    prompt = None
    for turn in turns:
        if not (
            isinstance(turn, dict)
            and isinstance(turn.get("from"), str)
            and isinstance(turn.get("value"), str)
        ):
            raise InputFileError(path, "each turn needs string 'from' and 'value'", line)
        if prompt is None and turn["from"] in _PROMPT_ROLES:
            prompt = turn["value"]
        elif prompt is not None and turn["from"] in _ANSWER_ROLES:
            return prompt, turn["value"]
    return None


def read_sharegpt(path: Path, limit: int | None, seed: int) -> TraceRead:
    """The first ``limit`` requests (None: all), reading the file only that far."""
    requests: list[Request] = []
    skipped = 0
    with collector_paused(), TextStream(path, "trace") as stream:
        for index, (line, item) in enumerate(_ArrayItems(stream)):
            pair = _pair(item, path, line)
            if pair is None:
                skipped += 1
                continue
            prompt, output = (_tokens(text) for text in pair)
            check_lengths(prompt, output, path, line)
            segment = text_segment(prompt, f"s{seed}/sharegpt/{index}")
            requests.append(
                new_request(f"r{len(requests)}", 0.0, (segment,), output, None, None, 1)
            )
            if len(requests) == limit:  # read no further
                break
    return TraceRead(requests, {"skipped_conversations": skipped})
