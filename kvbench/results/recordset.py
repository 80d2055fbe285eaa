"""Run records gathered from many files and folders (CI shards, machines, baselines)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import InputFileError, KvbenchError
from kvbench.results.schema import RunRecord, load_record

# Keys every run record has; other JSON files in a run folder (reports) are not records.
_RECORD_KEYS = {"schema_version", "engine", "suite", "summary"}


@dataclass(frozen=True, slots=True)
class FoundRecord:
    path: Path
    record: RunRecord

    @property
    def key(self) -> tuple[str, str]:
        return (self.record.suite, self.record.engine)


def _is_record_file(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.keys() >= _RECORD_KEYS


def record_files(paths: Iterable[str | Path]) -> list[Path]:
    """Record files named directly, and every record file under named folders (at any
    depth, so a folder of downloaded CI artifacts works as it is)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += [
                f for f in sorted(p.rglob("*.json"))
                if not any(part.startswith(".") for part in f.relative_to(p).parts)
                and _is_record_file(f)
            ]
        elif p.is_file():
            files.append(p)
        else:
            raise InputFileError(p, "no such file or folder")
    return files


def load_records(paths: Iterable[str | Path]) -> list[FoundRecord]:
    paths = list(paths)
    found = [FoundRecord(f, load_record(f)) for f in record_files(paths)]
    if not found:
        raise KvbenchError(f"no run records in {', '.join(map(str, paths))}")
    return found
