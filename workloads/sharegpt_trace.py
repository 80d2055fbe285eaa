"""ShareGPT JSON: a list of ``{"conversations": [{"from", "value"}, ...]}``.

The first human turn is the prompt, the first model turn after it the output. With no
tokenizer offline, lengths are estimated as ``ceil(characters / 4)`` tokens (at least 1),
the usual rule of thumb for English BPE vocabularies. Conversations without such a pair are
skipped (counted in the workload spec). ShareGPT has no timestamps: every request arrives at
0 s.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError
from kvbench.fileio import read_text
from kvbench.workloads.bulk import collector_paused, new_request, text_segment
from kvbench.workloads.model import Request
from kvbench.workloads.trace_rows import TraceRead, check_lengths

SHAREGPT_CHARS_PER_TOKEN = 4
_PROMPT_ROLES = frozenset({"human", "user"})
_ANSWER_ROLES = frozenset({"gpt", "chatgpt", "assistant"})
_WS = re.compile(r"[ \t\n\r]*")


def _json_array_items(text: str, path: Path) -> Iterator[tuple[int, Any]]:
    """The items of a top-level JSON array, each with the line it starts on."""
    decoder = json.JSONDecoder()
    ws = _WS
    pos = ws.match(text, 0).end()
    if text[pos : pos + 1] != "[":
        raise InputFileError(path, "expected a JSON array of conversations", 1)
    line, counted = 1, 0
    pos = ws.match(text, pos + 1).end()
    if text[pos : pos + 1] == "]":
        return
    while True:
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise InputFileError(path, f"not valid JSON: {e.msg}", e.lineno) from None
        yield line, item
        pos = ws.match(text, pos).end()
        sep = text[pos : pos + 1]
        if sep == "]":
            return
        if sep != ",":
            where = line + text.count("\n", counted, pos)
            raise InputFileError(path, "expected ',' or ']' after a conversation", where)
        pos = ws.match(text, pos + 1).end()


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
    requests: list[Request] = []
    skipped = 0
    with collector_paused():
        for index, (line, item) in enumerate(_json_array_items(read_text(path, "trace"), path)):
            if limit is not None and len(requests) >= limit:
                break
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
    return TraceRead(requests, {"skipped_conversations": skipped})
