"""Workload files: JSONL, a header line then one request per line.

The header is ``{"kvbench_workload": SCHEMA_VERSION, "name", "seed", "spec", "source",
"digest", "num_requests"}``; each later line is ``Request.to_json()``. Loading keeps file
order, requires non-decreasing arrivals and unique ids, and checks the digest, so a file
edited by hand is caught instead of silently benchmarking something else.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvbench.errors import InputFileError, KvbenchError

from .model import Request, Segment, Workload
from .presets import generate_preset, preset_names
from .validation import validation_message

SCHEMA_VERSION = 1


class _Record(BaseModel):
    # Strict: a workload file is written by kvbench, so "12" or 12.0 for a count is an error.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SegmentRecord(_Record):
    kind: Literal["text", "image", "audio"]
    tokens: int = Field(ge=1)
    key: str = Field(min_length=1)
    height: int | None = Field(None, ge=1)
    width: int | None = Field(None, ge=1)
    seconds: float | None = Field(None, gt=0)
    rule: str | None = None


class RequestRecord(_Record):
    id: str = Field(min_length=1)
    arrival_s: float = Field(ge=0)
    segments: list[SegmentRecord] = Field(min_length=1)
    output_tokens: int = Field(ge=0)
    prefix_group: str | None = None
    session_id: str | None = None
    n: int = Field(1, ge=1)

    @field_validator("arrival_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("arrival_s must be a finite number of seconds")
        return v

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
    p.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "kvbench_workload": SCHEMA_VERSION,
        "name": workload.name,
        "seed": workload.seed,
        "spec": workload.spec,
        "source": workload.source,
        "digest": workload.digest,
        "num_requests": len(workload.requests),
    }
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            for r in workload.requests:
                f.write(json.dumps(r.to_json()) + "\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def _read_header(path: Path, first: str) -> WorkloadHeader:
    try:
        raw = json.loads(first)
    except json.JSONDecodeError as e:
        raise InputFileError(path, f"header is not valid JSON: {e.msg}", 1) from e
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


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file written by ``save_workload``."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as e:
        raise InputFileError(p, "no such file") from e
    if not lines:
        raise InputFileError(p, "empty file; expected a kvbench workload header line")
    header = _read_header(p, lines[0])
    requests: list[Request] = []
    seen: set[str] = set()
    for line_no, text in enumerate(lines[1:], start=2):
        if not text.strip():
            continue
        try:
            r = RequestRecord.model_validate_json(text).to_request()
        except ValidationError as e:
            raise InputFileError(p, f"bad request: {validation_message(e)}", line_no) from e
        if requests and r.arrival_s < requests[-1].arrival_s:
            raise InputFileError(
                p,
                f"arrival_s {r.arrival_s} is before the previous request's "
                f"{requests[-1].arrival_s}; requests must be in arrival order",
                line_no,
            )
        if r.id in seen:
            raise InputFileError(p, f"request id {r.id!r} appears twice", line_no)
        seen.add(r.id)
        requests.append(r)
    if len(requests) != header.num_requests:
        raise InputFileError(
            p, f"header says {header.num_requests} requests but the file holds {len(requests)}"
            " (truncated or edited?)"
        )
    workload = Workload(
        name=header.name, requests=requests, seed=header.seed, spec=header.spec,
        source=header.source,
    )
    if workload.digest != header.digest:
        raise InputFileError(
            p,
            f"content digest {workload.digest} does not match the header's {header.digest}; "
            "the requests were changed after the file was written: regenerate it",
        )
    return workload


def load_workload_arg(text: str, num_requests: int | None = None, seed: int = 0) -> Workload:
    """A workload named on the command line: a preset name or a workload ``.jsonl`` path.

    Presets are generated with ``num_requests`` and ``seed``. A file keeps its own seed;
    ``num_requests`` then keeps its first that many requests.
    """
    if text in preset_names():
        return generate_preset(text, num_requests, seed)
    path = Path(text)
    if path.suffix != ".jsonl" and not path.is_file():
        raise KvbenchError(
            f"unknown workload {text!r}: not a preset (valid: {', '.join(preset_names())}); "
            "a path to a workload .jsonl file also works"
        )
    workload = load_workload(path)
    if num_requests is not None:
        if not 1 <= num_requests <= len(workload.requests):
            raise KvbenchError(
                f"{path} holds {len(workload.requests)} requests; ask for 1 to "
                f"{len(workload.requests)} (got {num_requests})"
            )
        workload.requests = workload.requests[:num_requests]
    return workload
