"""A run folder's manifest (``run.manifest``, JSON; not ``*.json``, so that a glob of the
folder finds only records): which run wrote the folder, the engines it planned and those it
finished, written when the run starts, as each engine ends and when it ends. Readers
(``report``, ``compare``, ``publish``) use it to refuse a folder that mixes the records of
two runs and to flag one whose run never finished (killed, out of disk)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic

MANIFEST = "run.manifest"
KIND = "kvbench-run-manifest"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["kvbench-run-manifest"] = KIND
    run_id: str
    command: str
    started_utc: str
    ended_utc: str | None = None
    status: Literal["running", "ok", "interrupted", "failed"] = "running"
    engines_planned: list[str]
    engines_finished: list[str] = []

    def write(self, folder: Path) -> None:
        write_text_atomic(folder / MANIFEST, self.model_dump_json(indent=1) + "\n")

    def finish(self, folder: Path, status: Literal["ok", "interrupted", "failed"]) -> None:
        self.status, self.ended_utc = status, _now()
        self.write(folder)


def start_manifest(folder: Path, run_id: str, command: str, engines: list[str]) -> Manifest:
    manifest = Manifest(run_id=run_id, command=command, started_utc=_now(),
                        engines_planned=engines)
    manifest.write(folder)
    return manifest


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest; None where it has none (folders written before manifests, or
    by hand)."""
    path = folder / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise KvbenchError(f"{path}: cannot be read ({exc}); remove it or write the run "
                           "again") from None
    try:
        return Manifest.model_validate(json.loads(text))
    except (ValueError, ValidationError):
        raise KvbenchError(f"{path}: not a kvbench run manifest; remove it or write the run "
                           "again") from None


def check_folders(found: Iterable[tuple[Path, str | None, str]]) -> list[str]:
    """:func:`check_folder` for each folder of the records found, as (path, run id,
    engine)."""
    folders: dict[Path, list[tuple[Path, str | None, str]]] = {}
    for item in found:
        folders.setdefault(item[0].parent, []).append(item)
    return [w for folder, items in folders.items() for w in check_folder(folder, items)]


def check_folder(folder: Path, records: list[tuple[Path, str | None, str]]) -> list[str]:
    """Warnings about a run folder read as one run, given its records as (path, run id,
    engine). Records of another run than the manifest's are refused (the folder mixes two
    runs); a run that never finished, or whose planned engines are missing, is flagged."""
    manifest = read_manifest(folder)
    if manifest is None:
        return []
    foreign = [p.name for p, run_id, _ in records
               if run_id is not None and run_id != manifest.run_id]
    if foreign:
        raise KvbenchError(
            f"{folder} mixes runs: {', '.join(foreign[:4])} were written by another run than "
            f"its manifest's ({manifest.run_id}: {manifest.command}); give each run its own "
            "folder (--out)")
    warnings = []
    if manifest.status == "running":
        warnings.append(f"{folder}: its run never finished (killed, or still running: "
                        f"started {manifest.started_utc}); figures are of the engines it "
                        "finished")
    engines = {engine for _, _, engine in records}
    missing = [e for e in manifest.engines_planned if e not in engines]
    if missing:
        warnings.append(f"{folder}: no records of {', '.join(missing)}, which the run planned")
    partial = sorted(p.name for p in folder.glob(".*.tmp"))
    if partial:
        warnings.append(f"{folder}: holds files a killed writer left half-written "
                        f"({', '.join(partial[:3])})")
    return warnings
