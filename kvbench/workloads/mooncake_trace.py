"""The Mooncake trace JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``), as kvcache-ai/Mooncake publishes it (Apache-2.0).

Each hash id is a 512-token prompt block; equal ids are equal content, so requests with
equal leading ids share those blocks' token ids. Arrivals are the timestamps, relative to the
earliest row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError
from kvbench.workloads.bulk import collector_paused, new_request, text_segment
from kvbench.workloads.model import Segment
from kvbench.workloads.textstream import TextStream, json_line, numbered_lines
from kvbench.workloads.trace_rows import TraceRead, TraceTimes, check_lengths, int_field

MOONCAKE_BLOCK_TOKENS = 512


def _segments(
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
            seg = blocks[(h, tokens)] = text_segment(tokens, f"s{seed}/mooncake/{h}")
        segs.append(seg)
    return tuple(segs)


def _row(
    text: str, blocks: dict[tuple[int, int], Segment], seed: int, path: Path, line: int
) -> tuple[float, tuple[Segment, ...], int]:
    """One trace line as (timestamp ms, prompt segments, output tokens)."""
    obj = json_line(text, path, line, "Mooncake trace row")
    if not isinstance(obj, dict):
        raise InputFileError(path, "each line must be a JSON object", line)
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not ts >= 0:
        raise InputFileError(path, f"timestamp must be ms >= 0 (got {ts!r})", line)
    if not math.isfinite(ts):
        raise InputFileError(path, f"timestamp must be a finite number (got {ts!r})", line)
    n_in = int_field(obj.get("input_length"), "input_length", 1, path, line)
    n_out = int_field(obj.get("output_length"), "output_length", 0, path, line)
    check_lengths(n_in, n_out, path, line)
    return float(ts), _segments(obj.get("hash_ids"), n_in, blocks, seed, path, line), n_out


def read_mooncake(path: Path, limit: int | None, seed: int) -> TraceRead:
    """The first ``limit`` rows (None: all), reading the file only that far."""
    times = TraceTimes(path, 1000.0, lambda ms: f"{ms} ms")
    rows: list[tuple[tuple[Segment, ...], int]] = []
    blocks: dict[tuple[int, int], Segment] = {}
    with collector_paused():
        with TextStream(path, "trace") as stream:
            for line, text in numbered_lines(stream):
                if text.strip():
                    ts, segs, n_out = _row(text, blocks, seed, path, line)
                    times.add(ts, line)
                    rows.append((segs, n_out))
                    if len(rows) == limit:  # read no further
                        break
        return TraceRead([
            new_request(f"r{i}", arrival, segs, n_out, None, None, 1)
            for i, (arrival, (segs, n_out)) in enumerate(
                zip(times.arrivals_s(), rows, strict=True)
            )
        ])
