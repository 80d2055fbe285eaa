"""The output folder of a run, checked before any engine starts: a run must not spend an hour
and then fail to write, nor mix its records with an earlier run's."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import tempfile
from pathlib import Path
from typing import IO

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


LOCK = ".kvbench.lock"


class OutDirLock:
    """A run's hold on its output folder: a POSIX lock on ``.kvbench.lock`` (per process, so
    one process may plan several runs into a folder; another process is refused), released
    when the process ends, however it ends."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        try:
            self.file: IO[str] | None = open(self.path, "a+")  # noqa: SIM115 (held)
        except OSError as exc:
            raise KvbenchError(f"--out {folder}: cannot lock it ({exc.strerror})") from None
        try:
            fcntl.lockf(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self.file.seek(0)
            holder = self.file.read().strip() or "?"
            self.file.close()
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise KvbenchError(f"--out {folder}: cannot lock it ({exc.strerror})") from None
            raise KvbenchError(
                f"--out {folder}: another kvbench run (process {holder}) is writing there; "
                "give this run another folder"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()

    def release(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def prepare_out_dir(path: Path, force: bool = False) -> OutDirLock:
    """Create ``path``, prove it writable and lock it for this run. Records an earlier run
    left there are refused (``report`` would mix them with this run's) unless ``force``,
    which removes them; half-written files a killed run left are removed."""
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
    lock = OutDirLock(path)
    stale = sorted(p for p in path.glob("*.json") if _is_record(p))
    if stale and not force:
        names = ", ".join(p.name for p in stale[:4]) + (", ..." if len(stale) > 4 else "")
        lock.release()
        raise KvbenchError(
            f"--out {path} already holds run records ({names}); give a new folder, or "
            "--force to replace them"
        )
    for p in stale:
        p.unlink()
    for p in path.glob(".*.tmp"):  # the lock is ours, so nobody is writing them
        p.unlink(missing_ok=True)
    return lock
