"""Workload files: JSONL, a header line then one request per line.

The header is ``{"kvbench_workload": SCHEMA_VERSION, "name", "seed", "spec", "source",
"digest", "num_requests"}``; each later line is ``Request.to_json()``. Loading keeps file
order, requires non-decreasing arrivals, unique ids and values within ``limits``, and checks
the digest, so a file edited by hand is caught instead of silently benchmarking something
else. The file is read as a stream, only as far as the requests asked for. Files are UTF-8;
a byte-order mark is dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvbench.errors import InputFileError, KvbenchError
from kvbench.fileio import open_atomic
from kvbench.workloads.limits import (
    MAX_SAMPLES,
    MAX_SEQUENCE_TOKENS,
    arrival_problem,
    check_generation_memory,
    request_problem,
)
from kvbench.workloads.model import Request, Segment, Workload
from kvbench.workloads.presets import generate_preset, preset_names
from kvbench.workloads.textstream import TextStream, numbered_lines, too_deep
from kvbench.workloads.traces import TRACE_KINDS, import_trace
from kvbench.workloads.validation import validation_message

SCHEMA_VERSION = 1


class _Record(BaseModel):
    # Strict: a workload file is written by kvbench, so "12" or 12.0 for a count is an error.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SegmentRecord(_Record):
    kind: Literal["text", "image", "audio"]
    tokens: int = Field(ge=1, le=MAX_SEQUENCE_TOKENS)
    key: str = Field(min_length=1)
    height: int | None = Field(None, ge=1)
    width: int | None = Field(None, ge=1)
    seconds: float | None = Field(None, gt=0)
    rule: str | None = None


class RequestRecord(_Record):
    id: str = Field(min_length=1)
    arrival_s: float
    segments: list[SegmentRecord] = Field(min_length=1)
    output_tokens: int = Field(ge=0, le=MAX_SEQUENCE_TOKENS)
    prefix_group: str | None = None
    session_id: str | None = None
    n: int = Field(1, ge=1, le=MAX_SAMPLES)

    @field_validator("arrival_s")
    @classmethod
    def _sane_arrival(cls, v: float) -> float:
        problem = arrival_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _sane_lengths(self) -> RequestRecord:
        problem = request_problem(sum(s.tokens for s in self.segments), self.output_tokens)
        if problem is not None:
            raise ValueError(problem)
        return self

    def to_request(self) -> Request:
        segs = tuple(
            Segment(s.kind, s.tokens, s.key, s.height, s.width, s.seconds, s.rule)
            for s in self.segments
        )
        return Request(
            id=self.id, arrival_s=self.arrival_s, segments=segs,
            output_tokens=self.output_tokens, prefix_group=self.prefix_group,
            session_id=self.session_id, n=self.n,
        )


class WorkloadHeader(_Record):
    kvbench_workload: int
    name: str
    seed: int
    spec: dict[str, Any]
    source: str
    digest: str
    num_requests: int = Field(ge=1)


def save_workload(workload: Workload, path: str | Path) -> Path:
    """Write ``workload`` to ``path`` atomically (a reader never sees half a file)."""
    p = Path(path)
    header = {
        "kvbench_workload": SCHEMA_VERSION,
        "name": workload.name,
        "seed": workload.seed,
        "spec": workload.spec,
        "source": workload.source,
        "digest": workload.digest,
        "num_requests": len(workload.requests),
    }
    with open_atomic(p) as f:
        f.write(json.dumps(header) + "\n")
        for r in workload.requests:
            f.write(json.dumps(r.to_json()) + "\n")
    return p


def _read_header(path: Path, first: str) -> WorkloadHeader:
    try:
        raw = json.loads(first)
    except json.JSONDecodeError as e:
        raise InputFileError(path, f"header is not valid JSON: {e.msg}", 1) from e
    except RecursionError:
        raise too_deep(path, "kvbench workload header", 1) from None
    if not isinstance(raw, dict) or "kvbench_workload" not in raw:
        raise InputFileError(
            path, "not a kvbench workload file (the first line has no 'kvbench_workload')", 1
        )
    if raw["kvbench_workload"] != SCHEMA_VERSION:
        raise InputFileError(
            path,
            f"workload schema version {raw['kvbench_workload']!r} is not supported (this "
            f"kvbench reads version {SCHEMA_VERSION}); regenerate the file with this version",
            1,
        )
    try:
        return WorkloadHeader.model_validate(raw)
    except ValidationError as e:
        raise InputFileError(path, f"bad header: {validation_message(e)}", 1) from e


def load_workload(path: str | Path, limit: int | None = None) -> Workload:
    """Read and validate a workload file written by ``save_workload``.

    ``limit`` keeps the first that many requests, and the file is read only that far: the
    first requests of a file of any size load in the same time and memory. The header's
    request count and content digest cover the whole file, so they are checked when all of
    it is read (no ``limit``, or one of at least the header's count); when the file holds
    fewer than ``limit`` requests, all are kept and ``Workload.warnings`` says so.
    """
    if limit is not None and limit < 1:
        raise KvbenchError(f"the number of requests must be >= 1 (got {limit})")
    p = Path(path)
    with TextStream(p, "workload") as stream:
        lines = numbered_lines(stream)
        first = next(lines, None)
        if first is None:
            raise InputFileError(p, "empty file; expected a kvbench workload header line")
        header = _read_header(p, first[1])
        whole = limit is None or limit >= header.num_requests
        wanted = header.num_requests if whole else limit
        # Refused before any row is read; a segment per request makes the estimate a floor.
        check_generation_memory(wanted, wanted, wanted, str(p))
        requests = _read_requests(p, lines, None if whole else limit)
    if whole and len(requests) != header.num_requests:
        raise InputFileError(
            p, f"header says {header.num_requests} requests but the file holds {len(requests)}"
            " (truncated or edited?)"
        )
    workload = Workload(
        name=header.name, requests=requests, seed=header.seed, spec=header.spec,
        source=header.source,
    )
    if whole and workload.digest != header.digest:
        raise InputFileError(
            p,
            f"content digest {workload.digest} does not match the header's {header.digest}; "
            "the requests were changed after the file was written: regenerate it",
        )
    if limit is not None and limit > len(requests):
        workload.warnings.append(
            f"asked for {limit:,} requests but {p} holds {len(requests):,}; using all of them"
        )
    return workload


def _read_requests(
    path: Path, lines: Iterator[tuple[int, str]], limit: int | None
) -> list[Request]:
    """The requests on ``lines``, in order, up to ``limit`` of them (None: every one)."""
    requests: list[Request] = []
    seen: set[str] = set()
    for line_no, text in lines:
        if not text.strip():
            continue
        try:
            r = RequestRecord.model_validate_json(text).to_request()
        except ValidationError as e:
            raise InputFileError(path, f"bad request: {validation_message(e)}", line_no) from e
        if requests and r.arrival_s < requests[-1].arrival_s:
            raise InputFileError(
                path,
                f"arrival_s {r.arrival_s} is before the previous request's "
                f"{requests[-1].arrival_s}; requests must be in arrival order",
                line_no,
            )
        if r.id in seen:
            raise InputFileError(path, f"request id {r.id!r} appears twice", line_no)
        seen.add(r.id)
        requests.append(r)
        if len(requests) == limit:  # read no further
            break
    return requests


def load_workload_arg(text: str, num_requests: int | None = None, seed: int = 0) -> Workload:
    """A workload named on the command line: a preset name, ``KIND:PATH`` of a trace (see
    ``TRACE_KINDS``) or a workload ``.jsonl`` path.

    Presets are generated with ``num_requests`` and ``seed``; traces are imported with
    ``seed``. A file keeps its own seed. For traces and files ``num_requests`` keeps the
    first that many requests, with a warning on the workload when there are fewer.
    """
    if text in preset_names():
        return generate_preset(text, num_requests, seed)
    kind, sep, rest = text.partition(":")
    if sep and kind in TRACE_KINDS and rest:
        return import_trace(kind, rest, limit=num_requests, seed=seed)
    path = Path(text)
    # os.path.exists, not Path.exists: a name too long for the file system is no file.
    if path.suffix != ".jsonl" and not os.path.exists(path):
        raise KvbenchError(
            f"unknown workload {text!r}: not a preset (valid: {', '.join(preset_names())}); "
            "a path to a workload .jsonl file or KIND:TRACE_PATH (KIND one of "
            f"{', '.join(TRACE_KINDS)}) also works"
        )
    return load_workload(path, limit=num_requests)
