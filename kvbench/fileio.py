"""File access shared by every command: atomic writes (a reader never sees a half-written
record, table or workload) and reading input text files with clear errors."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvbench.errors import InputFileError


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide records and tables from other users
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of the input file ``path`` (``what`` it should be, e.g. "suite", for
    messages), a leading byte-order mark dropped. A folder or other non-file, a missing or
    unreadable file and bytes that are not UTF-8 each get an InputFileError naming the file
    and saying what is wrong."""
    path = Path(path)
    if path.is_dir():
        raise InputFileError(path, f"is a folder; name a {what} file")
    if path.exists() and not path.is_file():
        raise InputFileError(path, f"is not a regular file; name a {what} file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputFileError(path, f"no such {what} file") from None
    except OSError as exc:
        raise InputFileError(path, f"cannot read {what}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputFileError(
            path, f"not a {what}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); is it a binary or damaged file?"
        ) from None
    return text
