"""The Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

Published by Azure/AzurePublicDataset (2023: conversation and code services; 2024: a week of
both), CC-BY 4.0. Each row is one request whose prompt is ``ContextTokens`` text tokens and
whose output is ``GeneratedTokens``. Arrivals are the timestamps, relative to the earliest
row. Timestamps look like ``2023-11-16 18:15:46.6805900`` (2023), ``2024-05-10
00:00:00.009930+00:00`` (2024) or ``2024-10-15T12:00:00.269Z``; up to nine fractional
digits are kept exactly and a UTC offset is applied.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Iterator
from datetime import date, datetime, timedelta
from functools import lru_cache
from pathlib import Path

from kvbench.errors import InputFileError
from kvbench.workloads.bulk import collector_paused, new_request, text_segment
from kvbench.workloads.textstream import TextStream
from kvbench.workloads.trace_rows import TraceRead, TraceTimes, check_lengths, int_field

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TIME = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(Z|[+-]\d{2}:?\d{2})?"
)
_EPOCH = date(1970, 1, 1)
NS_PER_S = 1_000_000_000


@lru_cache(maxsize=4096)
def _day_s(text: str) -> int:
    """Seconds from 1970-01-01 to midnight of a ``YYYY-MM-DD`` day (ValueError if none)."""
    return (date.fromisoformat(text) - _EPOCH).days * 86_400


def _offset_s(zone: str | None) -> int:
    if zone is None or zone == "Z":
        return 0
    digits = zone[1:].replace(":", "")
    seconds = int(digits[:2]) * 3600 + int(digits[2:]) * 60
    return -seconds if zone[0] == "-" else seconds


def azure_time_ns(text: str, path: Path, line: int) -> int:
    """Nanoseconds since 1970-01-01 UTC of an Azure trace TIMESTAMP."""
    m = _TIME.fullmatch(text.strip())
    if m is None:
        raise InputFileError(
            path, f"TIMESTAMP {text!r} is not like '2023-11-16 18:15:46.6805900'", line
        )
    day, hour, minute, second, frac, zone = m.groups()
    try:
        midnight = _day_s(day)
    except ValueError as e:
        raise InputFileError(path, f"TIMESTAMP {text!r} is not a real date ({e})", line) from None
    h, mi, s = int(hour), int(minute), int(second)
    if h > 23 or mi > 59 or s > 59:
        raise InputFileError(path, f"TIMESTAMP {text!r} is not a real time of day", line)
    whole = midnight + h * 3600 + mi * 60 + s - _offset_s(zone)
    return whole * NS_PER_S + int((frac or "").ljust(9, "0"))


def show_ns(ns: int) -> str:
    """An ns timestamp as UTC date and time, for messages."""
    return (datetime(1970, 1, 1) + timedelta(microseconds=ns // 1000)).isoformat(sep=" ")


class CsvTable:
    """A CSV file, read as a stream, whose header must name ``columns``; if not,
    ``hint(header)`` ends the message (say, which kind of trace the header looks like)."""

    def __init__(
        self,
        stream: TextStream,
        columns: tuple[str, ...],
        hint: Callable[[list[str]], str] = lambda header: "",
    ) -> None:
        self.path = path = stream.path
        self._reader = csv.reader(stream.lines())
        self.header = [h.strip() for h in self._row() or []]
        missing = [c for c in columns if c not in self.header]
        if missing:
            raise InputFileError(
                path,
                f"missing column(s) {', '.join(missing)}; expected the header "
                f"{','.join(columns)} but found {','.join(self.header) or 'nothing'}"
                f"{hint(self.header)}",
                1,
            )
        self._where = [self.header.index(c) for c in columns]

    def _row(self) -> list[str] | None:
        """The next row (``[]`` for a blank line), None at the end."""
        try:
            return next(self._reader, None)
        except csv.Error as e:
            raise InputFileError(
                self.path, f"not a readable CSV row: {e}", self._reader.line_num + 1
            ) from None

    def rows(self, limit: int | None) -> Iterator[tuple[int, list[str]]]:
        """``(line, values of the columns)`` per data row, the first ``limit`` rows."""
        width = len(self.header)
        count = 0
        while limit is None or count < limit:
            row = self._row()
            if row is None:
                return
            if not row:
                continue
            line = self._reader.line_num
            if len(row) != width:
                raise InputFileError(self.path, f"expected {width} columns, got {len(row)}", line)
            count += 1
            yield line, [row[i] for i in self._where]


def _lmm_hint(header: list[str]) -> str:
    return "; this is the Azure LMM trace: import it as kind azure-lmm" if (
        "NumImages" in header) else ""


def read_azure(path: Path, limit: int | None, seed: int) -> TraceRead:
    """The first ``limit`` rows (None: all), reading the file only that far."""
    warnings = []
    times = TraceTimes(path, float(NS_PER_S), show_ns)
    lengths: list[tuple[int, int]] = []
    with TextStream(path, "trace") as stream:
        table = CsvTable(stream, AZURE_COLUMNS, _lmm_hint)
        if "NumImages" in table.header:
            warnings.append(
                f"{path} has a NumImages column (the Azure LMM trace): importing it as azure "
                "counts its image tokens as text; import it as azure-lmm to keep the images"
            )
        for line, (stamp, context, generated) in table.rows(limit):
            times.add(azure_time_ns(stamp, path, line), line)
            prompt = int_field(context, "ContextTokens", 1, path, line)
            output = int_field(generated, "GeneratedTokens", 0, path, line)
            check_lengths(prompt, output, path, line)
            lengths.append((prompt, output))
    with collector_paused():
        requests = [
            new_request(
                f"r{i}", arrival, (text_segment(prompt, f"s{seed}/azure/{i}"),), output,
                None, None, 1,
            )
            for i, (arrival, (prompt, output)) in enumerate(
                zip(times.arrivals_s(), lengths, strict=True)
            )
        ]
    return TraceRead(requests, warnings=warnings)
