"""Run records gathered from many files and folders (CI shards, machines, baselines)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError, KvbenchError
from kvbench.results.schema import RunRecord, load_record, read_json, record_from_data


@dataclass(frozen=True, slots=True)
class FoundRecord:
    path: Path
    record: RunRecord

    @property
    def key(self) -> tuple[str, str]:
        return (self.record.suite, self.record.engine)


def _claims_to_be_record(data: Any) -> bool:
    # Run folders also hold other JSON (gate reports, profiles, traces): those are no
    # records. A file that says it is one, or has a record's engine and summary, is judged
    # as one, so that a damaged record fails loudly instead of going missing.
    return isinstance(data, dict) and ("schema_version" in data or data.keys() >= {
        "engine", "summary"})


def read_folder_record(path: Path) -> RunRecord | None:
    """The record in a JSON file found in a folder; None for JSON that is not a record.
    A file that cannot be read or parsed (truncated, binary) is an InputFileError: it may
    have been a record."""
    data = read_json(path)
    return record_from_data(path, data) if _claims_to_be_record(data) else None


def _json_files(folder: Path) -> list[Path]:
    return [
        f for f in sorted(folder.rglob("*.json"))
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts)
    ]


def find_records(paths: Iterable[str | Path]) -> list[FoundRecord]:
    """Record files named directly, and every record file under named folders (at any
    depth, so a folder of downloaded CI artifacts works as it is)."""
    found: list[FoundRecord] = []
    for p in map(Path, paths):
        if p.is_dir():
            for f in _json_files(p):
                record = read_folder_record(f)
                if record is not None:
                    found.append(FoundRecord(f, record))
        elif p.exists():
            found.append(FoundRecord(p, load_record(p)))
        else:
            raise InputFileError(p, "no such file or folder")
    return found


def load_records(paths: Iterable[str | Path]) -> list[FoundRecord]:
    paths = list(paths)
    found = find_records(paths)
    if not found:
        raise KvbenchError(f"no run records in {', '.join(map(str, paths))}")
    return found
