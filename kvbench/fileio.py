"""File access shared by every command: atomic writes (a reader never sees a half-written
record, table or workload) and reading input text files with clear errors."""

from __future__ import annotations

import codecs
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from kvbench.errors import InputFileError


@contextmanager
def open_atomic(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A file to write ``path`` through: a temporary file beside it, renamed into place when
    the block ends, removed if it raises (a reader never sees a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name must fit where the final one does: the longest names are cut.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:200]}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide records and tables from other users
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    with open_atomic(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


# Leading bytes of files people pass by mistake, with what to do instead.
SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "is gzip-compressed; decompress it first (gunzip -k FILE)"),
    (b"PK\x03\x04", "is a zip archive; extract the file from it first"),
    (b"\x28\xb5\x2f\xfd", "is zstd-compressed; decompress it first (zstd -d FILE)"),
    (b"BZh", "is bzip2-compressed; decompress it first (bunzip2 -k FILE)"),
    (codecs.BOM_UTF16_LE, "is UTF-16 text; save it as UTF-8"),
    (codecs.BOM_UTF16_BE, "is UTF-16 text; save it as UTF-8"),
)


def read_text(path: str | Path, what: str = "input") -> str:
    """The UTF-8 text of the input file ``path`` (``what`` it should be, e.g. "suite", for
    messages), a leading byte-order mark dropped, as spreadsheet exports and some Windows
    tools write one. Anything else gets an InputFileError naming the file (and the line)
    and saying what to do: a folder or other non-file, a missing or unreadable file, a
    compressed or UTF-16 file, bytes that are not UTF-8, a NUL byte."""
    path = Path(path)
    if path.is_dir():
        raise InputFileError(path, f"is a folder, not a {what} file; pass the file itself")
    if path.exists() and not path.is_file():
        raise InputFileError(path, f"is not a regular file; pass a {what} file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputFileError(path, f"no such file (a {what} file was expected)") from None
    except OSError as exc:
        raise InputFileError(path, f"cannot be read: {exc.strerror or exc}") from None
    for magic, problem in SIGNATURES:
        if data.startswith(magic):
            raise InputFileError(path, problem)
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = start + exc.start
        raise InputFileError(
            path, f"is not UTF-8 text (byte 0x{data[at]:02x} at offset {at:,}): a binary file "
            f"or another encoding? Give a {what} file saved as UTF-8",
            data.count(b"\n", 0, at) + 1,
        ) from None
    nul = text.find("\0")
    if nul >= 0:
        raise InputFileError(
            path, f"holds a NUL byte: a binary file, not a {what} file",
            text.count("\n", 0, nul) + 1,
        )
    return text
