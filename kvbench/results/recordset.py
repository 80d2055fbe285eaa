"""Run records gathered from many files and folders (CI shards, machines, baselines).

A record is read whole, so a file above ``schema.MAX_RECORD_BYTES`` (2 GiB) is refused before it is
read: a replay of a million requests writes a record of some hundred MB, so such a file is
no record kvbench wrote.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError, KvbenchError
from kvbench.results.schema import RunRecord, read_record_json, record_from_data


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
    data = read_record_json(path)
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
        if _is_folder(p):
            for f in _json_files(p):
                record = read_folder_record(f)
                if record is not None:
                    found.append(FoundRecord(f, record))
        else:
            found.append(FoundRecord(p, record_from_data(p, read_record_json(p))))
    return found


def _is_folder(path: Path) -> bool:
    """Whether ``path`` is a folder; a KvbenchError when it cannot be looked at (missing, or
    a name too long for the file system)."""
    try:
        return stat.S_ISDIR(path.stat().st_mode)
    except FileNotFoundError:
        raise InputFileError(path, "no such file or folder") from None
    except OSError as exc:
        raise InputFileError(path, f"cannot be read: {exc.strerror or exc}") from None


def load_records(paths: Iterable[str | Path]) -> list[FoundRecord]:
    paths = list(paths)
    found = find_records(paths)
    if not found:
        raise KvbenchError(f"no run records in {', '.join(map(str, paths))}")
    return found
