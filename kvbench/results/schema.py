"""RunRecord: the JSON file each engine run produces (one per engine), written atomically."""

from __future__ import annotations

import json
import numbers
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_core import core_schema

from kvbench.errors import InputFileError
from kvbench.fileio import open_atomic, read_text
from kvbench.results.slo import SLO
from kvbench.units import format_bytes

SCHEMA_VERSION = 1
# Summary key of a folded record's per-repeat values (see kvbench.results.repeats).
REPEATS_KEY = "repeats"
# Larger than any record kvbench writes (a million-request replay's is some hundred MB).
MAX_RECORD_BYTES = 2 << 30


class WorkloadInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    digest: str
    source: str
    seed: int
    num_requests: int
    prompt_tokens: int
    output_tokens: int


class RequestRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    n: int = 1
    status: Literal["ok", "rejected", "failed", "unfinished"]
    queue_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    preemptions: int = 0
    cached_tokens: int | None = 0
    output_digest: str | None = None
    reason: str | None = None  # why it was rejected or failed
    # Agreement with the full-precision reference pass (a reduced-precision KV run with real
    # compute; see the record's ``quality``): the share of output positions with the same
    # greedy token, the first that differs (None: none), and the first output token's
    # logits' max and mean absolute difference. None where not checked.
    output_match_rate: float | None = None
    first_divergence: int | None = None
    probe_max_abs_logit_diff: float | None = None
    probe_mean_abs_logit_diff: float | None = None


class RequestRows(Sequence[RequestRow]):
    """A record's per-request rows. A run's are made from its request timings when read, a
    chunk at a time, as the dicts of their fields (a replay of a million requests would
    otherwise hold a million row objects as long as its record); a record read from a file
    holds them."""

    __slots__ = ("_count", "_dicts", "_rows")
    CHUNK = 4096

    def __init__(self, count: int, dicts: Callable[[int, int], list[dict[str, Any]]],
                 rows: Callable[[int, int], list[RequestRow]] | None = None) -> None:
        """``dicts(start, stop)``: the fields of rows ``start .. stop-1``, every one, in
        :class:`RequestRow`'s order and of its types; ``rows``: the rows themselves, if
        held."""
        self._count, self._dicts = count, dicts
        self._rows = rows or (lambda start, stop: [
            RequestRow.model_construct(**fields) for fields in dicts(start, stop)])

    @classmethod
    def of(cls, rows: Sequence[RequestRow]) -> RequestRows:
        held = list(rows)
        return cls(len(held), lambda a, b: [row.model_dump() for row in held[a:b]],
                   lambda a, b: held[a:b])

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, key: int) -> RequestRow: ...
    @overload
    def __getitem__(self, key: slice) -> list[RequestRow]: ...

    def __getitem__(self, key: int | slice) -> RequestRow | list[RequestRow]:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._count)
            return self._rows(start, stop)[::step] if stop > start else []
        i = key + self._count if key < 0 else key
        if not 0 <= i < self._count:
            raise IndexError(f"request row {key} of {self._count}")
        return self._rows(i, i + 1)[0]

    def _spans(self) -> Iterator[tuple[int, int]]:
        for start in range(0, self._count, self.CHUNK):
            yield start, min(start + self.CHUNK, self._count)

    def __iter__(self) -> Iterator[RequestRow]:
        for start, stop in self._spans():
            yield from self._rows(start, stop)

    def dict_chunks(self) -> Iterator[list[dict[str, Any]]]:
        """The rows' fields, a chunk of rows at a time."""
        for start, stop in self._spans():
            yield self._dicts(start, stop)

    def column(self, name: str) -> list[Any]:
        """Field ``name`` of every row."""
        return [fields[name] for chunk in self.dict_chunks() for fields in chunk]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RequestRows | list | tuple):
            return len(self) == len(other) and all(
                a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RequestRows({self._count} rows)"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler
                                     ) -> core_schema.CoreSchema:
        from_list = core_schema.no_info_after_validator_function(
            cls.of, handler.generate_schema(list[RequestRow]))
        return core_schema.json_or_python_schema(
            json_schema=from_list,
            python_schema=core_schema.union_schema(
                [core_schema.is_instance_schema(cls), from_list]),
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda rows: [fields for chunk in _rows_of(rows).dict_chunks()
                              for fields in chunk]),
        )


def _rows_of(rows: Sequence[RequestRow]) -> RequestRows:
    return rows if isinstance(rows, RequestRows) else RequestRows.of(rows)


def request_column(rows: Sequence[RequestRow], name: str) -> list[Any]:
    """Field ``name`` of every request row of a record."""
    return _rows_of(rows).column(name)


_ROWS_JSON = TypeAdapter(list[dict[str, Any]])


class TelemetryInfo(BaseModel):
    """Which probes measured (``probes``: name -> "ok" or "unavailable: why"), facts they
    report once (e.g. device total memory), and which reading ``peak_device_bytes`` and
    ``device_growth_pct`` use."""

    model_config = ConfigDict(extra="forbid")
    probes: dict[str, str]
    facts: dict[str, Any] = {}
    device_memory: str | None = None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QualityInfo(_Strict):
    """Whether the run's output agreement with full precision was checked (``ran``), why not
    (``reason``), which modalities' KV the engine stores below the model's dtype, the
    reference pass it was compared with, the weights both used, and the probe set."""

    ran: bool
    reason: str | None = None
    below_full_precision: dict[str, str] = {}
    reference: str | None = None
    weights: str | None = None
    probe: str | None = None


class WaveMemory(_Strict):
    """Memory left after wave ``wave`` (1-based) drained, at run time ``t_s``."""

    wave: int
    t_s: float
    completed: int
    memory: dict[str, int]


class LeakFit(_Strict):
    bytes_per_wave: float
    growth_bytes: float  # fitted growth over the soak: slope x (waves - 1)
    growth_pct: float | None  # last wave vs first wave, relative to the first
    threshold_bytes: float | None  # growth above which a noisy kind counts as leaking
    leak: bool


class SoakResult(_Strict):
    waves: int
    waves_completed: int
    noise_pct: float
    noise_bytes: int
    per_wave: list[WaveMemory]
    fits: dict[str, LeakFit]
    leak_bytes_per_wave: dict[str, float]
    memory_growth_pct: float | None  # the largest growth_pct over kinds
    leak_detected: bool
    findings: list[str]

    def summary(self) -> dict[str, Any]:
        """Flat scalars for the record summary (dashboards and gates read these)."""
        out: dict[str, Any] = {
            "soak_waves": self.waves_completed,
            "soak_memory_growth_pct": self.memory_growth_pct,
            "leak_detected": self.leak_detected,
        }
        for kind, slope in self.leak_bytes_per_wave.items():
            out[f"leak_{kind.removesuffix('_bytes')}_bytes_per_wave"] = slope
        return out


# The warning a wall-clock record keeps when other work set its speed figures.
NOISY = "noisy-machine"


class MachineState(_Strict):
    """The machine while one engine ran on the wall clock: load averages (1, 5, 15 min)
    before and after, the share of CPU time stolen by a hypervisor or waiting on I/O
    (``/proc/stat``; None where the system has none) and the process's own CPU seconds."""

    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None
    cpu_count: int | None = None
    steal_pct: float | None = None
    iowait_pct: float | None = None
    user_cpu_s: float = 0.0
    system_cpu_s: float = 0.0
    # Why the run's speed figures are not to be trusted (the ``noisy-machine`` warning).
    noisy: str | None = None


class RunRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    kvbench_version: str
    git_commit: str | None
    # The run that wrote the record (its folder's manifest names the same).
    run_id: str | None = None
    created_utc: str
    machine: dict[str, Any]
    command: str
    suite: str
    workload: WorkloadInfo
    engine: str
    engine_config: dict[str, Any]
    model: dict[str, Any]
    device: str
    clock: str
    status: Literal["ok", "interrupted", "failed"]
    error: str | None = None
    slo: SLO | None = None
    telemetry: TelemetryInfo | None = None
    soak: SoakResult | None = None
    quality: QualityInfo | None = None
    # One per repeat, in run order, for wall-clock runs (empty on the virtual clock).
    machine_state: list[MachineState] = []
    # Warnings about the run kept with it (``noisy-machine: ...``).
    warnings: list[str] = []
    summary: dict[str, Any]
    curves: dict[str, list[float]]
    requests: RequestRows

    @field_validator("summary")
    @classmethod
    def _metric_values(cls, summary: dict[str, Any]) -> dict[str, Any]:
        """Metrics are numbers, true/false or null; anything else would reach the gate and
        the tables as something they cannot judge or show."""
        for key, value in summary.items():
            if key == REPEATS_KEY:
                if not isinstance(value, dict) or not all(
                    isinstance(v, list) and v and all(is_number(x) for x in v)
                    for v in value.values()
                ):
                    raise ValueError(
                        f"{REPEATS_KEY} must map metric names to non-empty lists of numbers"
                    )
            elif value is not None and not isinstance(value, numbers.Real):
                raise ValueError(
                    f"metric {key!r} is {type(value).__name__} {str(value)[:40]!r}; "
                    "metrics are numbers, true/false or null"
                )
        return summary

    def json_parts(self) -> Iterator[str]:
        """The record's JSON (as ``model_dump_json(indent=1)`` writes it), in parts: the
        request rows a chunk at a time."""
        head = self.model_copy(update={"requests": RequestRows(0, list)})
        text = head.model_dump_json(indent=1)
        end = '"requests": []\n}'
        if not text.endswith(end):  # the rows are the record's last field
            raise AssertionError("request rows are not the record's last field")
        rows = self.requests
        if not rows:
            yield text + "\n"
            return
        yield text[: -len(end)] + '"requests": [\n'
        for i, chunk in enumerate(_rows_of(rows).dict_chunks()):
            # A top-level list at indent 1 has its items one level less deep than here.
            rows = _ROWS_JSON.dump_json(chunk, indent=1).decode()[2:-2]
            yield (",\n " if i else " ") + rows.replace("\n", "\n ")
        yield "\n ]\n}\n"

    def to_json(self) -> str:
        return "".join(self.json_parts())

    def write(self, path: str | Path) -> Path:
        with open_atomic(path) as fh:
            for part in self.json_parts():
                fh.write(part)
        return Path(path)


def is_number(v: Any) -> bool:
    """A metric value that is a number (true/false are not)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def read_json(path: str | Path, what: str = "run record") -> Any:
    """A JSON file's content, or an InputFileError naming the file (and the line)."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputFileError(
            path, f"not valid JSON ({exc.msg}, column {exc.colno}): a truncated or damaged "
            f"{what}; remove it, or write it again",
            line=exc.lineno,
        ) from None


def read_record_json(path: str | Path) -> Any:
    """The parsed JSON of a file that may hold a record; a file too large to be one, or
    nested deeper than the parser recurses, is an InputFileError."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        size = 0  # read_json says what is wrong with the file
    if size > MAX_RECORD_BYTES:
        raise InputFileError(
            path, f"{format_bytes(size)} is more than the {format_bytes(MAX_RECORD_BYTES)} a "
            "run record may take (a million-request replay's is some hundred MB), so no "
            "record kvbench wrote: leave it out of the files and folders given",
        )
    try:
        return read_json(path)
    except RecursionError:
        raise InputFileError(
            path, f"nested too deeply to read (more than about {sys.getrecursionlimit():,} "
            "levels of arrays or objects): not a run record",
        ) from None


def record_from_data(path: str | Path, data: Any) -> RunRecord:
    """A run record from the parsed JSON of ``path``; the path is for messages."""
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise InputFileError(
            path, f"run record schema_version {version!r}; this kvbench reads {SCHEMA_VERSION}"
        )
    try:
        return RunRecord.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'record'}: {e['msg']}"
            for e in exc.errors()[:5]
        )
        more = f" (and {exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
        raise InputFileError(path, f"invalid run record: {problems}{more}") from None


def load_record(path: str | Path) -> RunRecord:
    return record_from_data(path, read_record_json(path))
