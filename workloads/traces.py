"""Importers for public request traces.

- ``azure``: Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).
  Arrivals are the timestamps, relative to the earliest imported row.
- ``mooncake``: Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``). Each hash id is a 512-token prompt block; equal ids are equal content, so
  requests with equal leading ids share those blocks' token ids.
- ``sharegpt``: ShareGPT JSON, a list of ``{"conversations": [{"from", "value"}, ...]}``.
  The first human turn is the prompt, the first model turn after it the output. With no
  tokenizer offline, lengths are estimated as ``ceil(characters / 4)`` tokens (at least 1),
  the usual rule of thumb for English BPE vocabularies. Conversations without such a pair
  are skipped (counted in the workload spec). ShareGPT has no timestamps: every request
  arrives at 0 s.

Content keys include the seed, as for generated workloads, so another seed gives other ids.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError, KvbenchError

from .model import Request, Segment, Workload

MOONCAKE_BLOCK_TOKENS = 512
SHAREGPT_CHARS_PER_TOKEN = 4
_SHAREGPT_PROMPT_ROLES = frozenset({"human", "user"})
_SHAREGPT_ANSWER_ROLES = frozenset({"gpt", "chatgpt", "assistant"})

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# The trace writes 7 fractional digits, more than datetime parses; keep them as integers.
_AZURE_TIME = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?")
_EPOCH = datetime(1970, 1, 1)


def _int_value(value: Any, what: str, lowest: int, path: Path, line: int) -> int:
    """``value`` as an int >= ``lowest``, else an error naming the file and line."""
    number = value
    if isinstance(value, str):
        digits = value.strip()
        number = int(digits) if digits.removeprefix("-").isdecimal() else None
    # type() rather than isinstance(): JSON true/false are bools, which are ints to Python.
    if type(number) is not int or number < lowest:
        raise InputFileError(path, f"{what} must be an integer >= {lowest} (got {value!r})", line)
    return number


def _azure_time_ns(text: str, path: Path, line: int) -> int:
    m = _AZURE_TIME.fullmatch(text.strip())
    if m is None:
        raise InputFileError(
            path, f"TIMESTAMP {text!r} is not like '2023-11-16 18:15:46.6805900'", line
        )
    whole = int((datetime.fromisoformat(m[1]) - _EPOCH).total_seconds())
    frac = (m[2] or "").ljust(9, "0")
    return whole * 1_000_000_000 + int(frac)


def _read_azure(path: Path, limit: int | None, seed: int) -> tuple[list[Request], dict[str, Any]]:
    times: list[int] = []
    lengths: list[tuple[int, int]] = []
    # utf-8-sig drops the byte-order mark the published CSV starts with.
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in _AZURE_COLUMNS if c not in header]
        if missing:
            raise InputFileError(
                path, f"missing column(s) {', '.join(missing)}; expected header "
                f"{','.join(_AZURE_COLUMNS)}", 1,
            )
        t_col, in_col, out_col = (header.index(c) for c in _AZURE_COLUMNS)
        width = len(header)
        for row in reader:
            if limit is not None and len(times) >= limit:
                break
            line = reader.line_num
            if not row:
                continue
            if len(row) != width:
                raise InputFileError(path, f"expected {width} columns, got {len(row)}", line)
            times.append(_azure_time_ns(row[t_col], path, line))
            lengths.append((
                _int_value(row[in_col], "ContextTokens", 1, path, line),
                _int_value(row[out_col], "GeneratedTokens", 0, path, line),
            ))
    t0 = min(times, default=0)
    requests = [
        Request(
            id=f"r{i}",
            arrival_s=(t - t0) / 1e9,
            segments=(Segment("text", prompt, f"s{seed}/azure/{i}"),),
            output_tokens=output,
        )
        for i, (t, (prompt, output)) in enumerate(zip(times, lengths, strict=True))
    ]
    return requests, {}


def _mooncake_segments(
    hash_ids: Any,
    input_length: int,
    blocks: dict[tuple[int, int], Segment],
    seed: int,
    path: Path,
    line: int,
) -> tuple[Segment, ...]:
    """One segment per block; ``blocks`` reuses the Segment of an already seen (id, length)."""
    if not isinstance(hash_ids, list) or not hash_ids or {type(h) for h in hash_ids} != {int}:
        raise InputFileError(path, "hash_ids must be a non-empty list of integers", line)
    block = MOONCAKE_BLOCK_TOKENS
    last = input_length - block * (len(hash_ids) - 1)
    if not 1 <= last <= block:
        raise InputFileError(
            path,
            f"input_length {input_length} does not fit {len(hash_ids)} blocks of {block} "
            f"tokens (the last block would hold {last}; it must hold 1..{block})",
            line,
        )
    segs = []
    for i, h in enumerate(hash_ids):
        tokens = last if i == len(hash_ids) - 1 else block
        seg = blocks.get((h, tokens))
        if seg is None:
            seg = blocks[(h, tokens)] = Segment("text", tokens, f"s{seed}/mooncake/{h}")
        segs.append(seg)
    return tuple(segs)


def _read_mooncake(
    path: Path, limit: int | None, seed: int
) -> tuple[list[Request], dict[str, Any]]:
    rows: list[tuple[float, tuple[Segment, ...], int]] = []
    blocks: dict[tuple[int, int], Segment] = {}
    with path.open(encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise InputFileError(path, f"not valid JSON: {e.msg}", line) from e
            if not isinstance(obj, dict):
                raise InputFileError(path, "each line must be a JSON object", line)
            ts = obj.get("timestamp")
            if isinstance(ts, bool) or not isinstance(ts, int | float) or not ts >= 0:
                raise InputFileError(path, f"timestamp must be ms >= 0 (got {ts!r})", line)
            n_in = _int_value(obj.get("input_length"), "input_length", 1, path, line)
            n_out = _int_value(obj.get("output_length"), "output_length", 0, path, line)
            segs = _mooncake_segments(obj.get("hash_ids"), n_in, blocks, seed, path, line)
            rows.append((float(ts), segs, n_out))
    t0 = min((r[0] for r in rows), default=0.0)
    requests = [
        Request(id=f"r{i}", arrival_s=(ts - t0) / 1000.0, segments=segs, output_tokens=n_out)
        for i, (ts, segs, n_out) in enumerate(rows)
    ]
    return requests, {}


def _json_array_items(text: str, path: Path) -> Iterator[tuple[int, Any]]:
    """The items of a top-level JSON array, each with the line it starts on."""
    decoder = json.JSONDecoder()
    ws = re.compile(r"[ \t\n\r]*")
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
            raise InputFileError(path, f"not valid JSON: {e.msg}", e.lineno) from e
        yield line, item
        pos = ws.match(text, pos).end()
        sep = text[pos : pos + 1]
        if sep == "]":
            return
        if sep != ",":
            where = line + text.count("\n", counted, pos)
            raise InputFileError(path, "expected ',' or ']' after a conversation", where)
        pos = ws.match(text, pos + 1).end()


def _sharegpt_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / SHAREGPT_CHARS_PER_TOKEN))


def _sharegpt_pair(item: Any, path: Path, line: int) -> tuple[str, str] | None:
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
        if prompt is None and turn["from"] in _SHAREGPT_PROMPT_ROLES:
            prompt = turn["value"]
        elif prompt is not None and turn["from"] in _SHAREGPT_ANSWER_ROLES:
            return prompt, turn["value"]
    return None


def _read_sharegpt(
    path: Path, limit: int | None, seed: int
) -> tuple[list[Request], dict[str, Any]]:
    requests: list[Request] = []
    skipped = 0
    for index, (line, item) in enumerate(_json_array_items(path.read_text("utf-8"), path)):
        if limit is not None and len(requests) >= limit:
            break
        pair = _sharegpt_pair(item, path, line)
        if pair is None:
            skipped += 1
            continue
        prompt, answer = pair
        requests.append(
            Request(
                id=f"r{len(requests)}",
                arrival_s=0.0,
                segments=(Segment("text", _sharegpt_tokens(prompt), f"s{seed}/sharegpt/{index}"),),
                output_tokens=_sharegpt_tokens(answer),
            )
        )
    return requests, {"skipped_conversations": skipped}


_Reader = Callable[[Path, int | None, int], tuple[list[Request], dict[str, Any]]]
_READERS: dict[str, _Reader] = {
    "azure": _read_azure,
    "mooncake": _read_mooncake,
    "sharegpt": _read_sharegpt,
}
TRACE_KINDS: tuple[str, ...] = tuple(_READERS)


def import_trace(kind: str, path: str | Path, limit: int | None = None, seed: int = 0) -> Workload:
    """Read a trace file of the given ``kind`` (``azure``, ``mooncake``, ``sharegpt``).

    ``limit`` keeps the first that many requests of the file. Requests keep file order
    (stably sorted by arrival) and are numbered ``r0, r1, …`` in file order.
    """
    if kind not in _READERS:
        raise KvbenchError(f"unknown trace kind {kind!r}; valid: {', '.join(TRACE_KINDS)}")
    if limit is not None and limit < 1:
        raise KvbenchError(f"limit must be >= 1 (got {limit})")
    p = Path(path)
    if not p.is_file():
        raise InputFileError(p, "no such file")
    found, facts = _READERS[kind](p, limit, seed)
    if not found:
        raise InputFileError(p, f"no requests found in this {kind} trace")
    spec = {"trace": kind, "file": p.name, "limit": limit, **facts}
    requests = sorted(found, key=lambda r: r.arrival_s)
    return Workload(name=p.stem, requests=requests, seed=seed, spec=spec, source=str(path))
