"""Workload and trace files read as a stream: a chunk at a time, so an importer that needs
the first N requests of a 10 GB file reads about N rows of it, in memory bounded by a chunk
and the longest line.

The checks are those of ``kvbench.fileio.read_text``, with the same messages, each made
as the bytes arrive: a folder or other non-file, a missing or unreadable file, a compressed
or UTF-16 file, bytes that are not UTF-8 (naming the offset and line), a NUL byte. A leading
UTF-8 byte-order mark is dropped. A line longer than ``MAX_LINE_CHARS`` is refused rather
than read whole: no row of a workload or trace comes near it, but a file without line ends
would otherwise be one line the size of the file.
"""

from __future__ import annotations

import codecs
import json
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from kvbench.errors import InputFileError
from kvbench.fileio import SIGNATURES

CHUNK_BYTES = 1 << 20
MAX_LINE_CHARS = 64 << 20


def _open(path: Path, what: str) -> BinaryIO:
    """``path`` opened for reading, after the checks that need no content."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InputFileError(path, f"no such file (a {what} file was expected)") from None
    except OSError as exc:  # too long a name, no permission on a folder, ...
        raise InputFileError(path, f"cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise InputFileError(path, f"is a folder, not a {what} file; pass the file itself")
    if not stat.S_ISREG(mode):  # a FIFO or device would block or never end
        raise InputFileError(path, f"is not a regular file; pass a {what} file")
    try:
        return path.open("rb")
    except OSError as exc:
        raise InputFileError(path, f"cannot be read: {exc.strerror or exc}") from None


class TextStream:
    """The UTF-8 text of the input file ``path`` (``what`` it should be, for messages), read
    on demand; use it as a context manager so the file is closed when the reader stops."""

    def __init__(self, path: str | Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._file = _open(self.path, what)
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._offset = 0  # file offset of the next bytes read
        self._newlines = 0  # line ends in the text handed out so far

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._file.close()

    def _first_bytes(self) -> bytes:
        data = self._file.read(CHUNK_BYTES)
        for magic, problem in SIGNATURES:
            if data.startswith(magic):
                raise InputFileError(self.path, problem)
        if data.startswith(codecs.BOM_UTF8):
            self._offset = len(codecs.BOM_UTF8)
            return data[len(codecs.BOM_UTF8):]
        return data

    def _decode(self, data: bytes, final: bool) -> str:
        pending = len(self._decoder.getstate()[0])
        try:
            text = self._decoder.decode(data, final)
        except UnicodeDecodeError as exc:
            at = self._offset - pending + exc.start
            raise InputFileError(
                self.path, f"is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                f"{at:,}): a binary file or another encoding? Give a {self.what} file saved "
                "as UTF-8",
                self._newlines + exc.object.count(b"\n", 0, exc.start) + 1,
            ) from None
        self._offset += len(data)
        nul = text.find("\0")
        if nul >= 0:
            raise InputFileError(
                self.path, f"holds a NUL byte: a binary file, not a {self.what} file",
                self._newlines + text.count("\n", 0, nul) + 1,
            )
        self._newlines += text.count("\n")
        return text

    def chunks(self) -> Iterator[str]:
        """The text, a chunk at a time (never an empty one)."""
        data = self._first_bytes()
        while data:
            text = self._decode(data, final=False)
            if text:
                yield text
            data = self._file.read(CHUNK_BYTES)
        text = self._decode(b"", final=True)
        if text:
            yield text

    def lines(self) -> Iterator[str]:
        """The text's lines, each with its ``\\n`` (the last may have none)."""
        carry: list[str] = []
        carried = 0
        done = 0
        for chunk in self.chunks():
            parts = chunk.split("\n")
            for part in parts[:-1]:
                carry.append(part)
                yield "".join(carry) + "\n"
                carry, carried = [], 0
                done += 1
            if parts[-1]:
                carry.append(parts[-1])
                carried += len(parts[-1])
                if carried > MAX_LINE_CHARS:
                    raise InputFileError(
                        self.path, f"a line longer than {MAX_LINE_CHARS >> 20} Mi characters: "
                        f"not a {self.what} file (a row is one line)", done + 1,
                    )
        if carry:
            yield "".join(carry)


def numbered_lines(stream: TextStream) -> Iterator[tuple[int, str]]:
    """``(line number, text without its line end)`` per line of ``stream``."""
    for number, line in enumerate(stream.lines(), start=1):
        yield number, line.removesuffix("\n")


def too_deep(path: Path, what: str, line: int | None = None) -> InputFileError:
    """The error for JSON nested deeper than the parser recurses (it recurses once per
    level, so the interpreter's recursion limit is the bound)."""
    return InputFileError(
        path, f"nested too deeply to read (more than about {sys.getrecursionlimit():,} levels "
        f"of arrays or objects): not a {what}", line,
    )


def json_line(text: str, path: Path, line: int, what: str) -> Any:
    """The JSON value on one line of a JSONL file, with errors naming the file and line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(path, f"not valid JSON: {e.msg}", line) from None
    except RecursionError:
        raise too_deep(path, what, line) from None
