"""The output folder of a run, checked before any engine starts: a run must not spend an hour
and then fail to write, nor mix its records with an earlier run's."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from kvbench.errors import KvbenchError

# How a run record begins (its first field): telling a record by its first bytes keeps a
# replay of a million requests, whose record is hundreds of MB, from being read in whole.
_RECORD_START = re.compile(rb'\s*\{\s*"schema_version"\s*:')


def _is_record(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            head = fh.read(256)
    except OSError:
        return False
    return _RECORD_START.match(head) is not None


def prepare_out_dir(path: Path, force: bool = False) -> Path:
    """Create ``path`` and prove it writable. Records an earlier run left there are refused
    (``report`` would mix them with this run's) unless ``force``, which removes them."""
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == path else f"lies under {p}, which is a file"
            raise KvbenchError(f"--out {path} {what}; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise KvbenchError(
            f"--out {path}: cannot write there ({exc.strerror or exc}); give a writable folder"
        ) from None
    stale = sorted(p for p in path.glob("*.json") if _is_record(p))
    if stale and not force:
        names = ", ".join(p.name for p in stale[:4]) + (", ..." if len(stale) > 4 else "")
        raise KvbenchError(
            f"--out {path} already holds run records ({names}); give a new folder, or "
            "--force to replace them"
        )
    for p in stale:
        p.unlink()
    return path
