"""File access shared by every command: atomic writes (a reader never sees a half-written
record, table or workload) and reading input text files with clear errors."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvbench.errors import InputFileError


def write_text_atomic(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide records and tables from other users
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_text(path: str | Path, what: str) -> str:
    """The text of the UTF-8 input file ``path`` (``what`` it should be, for messages), a
    leading byte-order mark dropped. A folder, a missing or unreadable file and bytes that
    are not UTF-8 text each get a message naming the file and what to give instead."""
    path = Path(path)
    if path.is_dir():
        raise InputFileError(path, f"is a folder; give the path of a {what}")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputFileError(path, f"no such file; give the path of a {what}") from None
    except OSError as exc:
        raise InputFileError(path, f"cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputFileError(
            path, f"is not UTF-8 text (byte {exc.start}); give a {what} saved as UTF-8", line
        ) from None
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise InputFileError(path, f"holds binary data (a NUL byte), not a {what}", line)
    return text.removeprefix("\ufeff")
