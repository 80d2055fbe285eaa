"""Reading input files as UTF-8 text, with errors that say what the file really is.

Traces and workload files are UTF-8 (a leading byte-order mark is dropped, as spreadsheet
exports and some Windows tools write one). Anything else is refused with the file, the line
where it goes wrong and what to do: a folder, a compressed or binary file, UTF-16 text, or
bytes that are not UTF-8.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from kvbench.errors import InputFileError

# Leading bytes of files people pass by mistake, with what to do instead.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "is gzip-compressed; decompress it first (gunzip -k FILE)"),
    (b"PK\x03\x04", "is a zip archive; extract the file from it first"),
    (b"\x28\xb5\x2f\xfd", "is zstd-compressed; decompress it first (zstd -d FILE)"),
    (b"BZh", "is bzip2-compressed; decompress it first (bunzip2 -k FILE)"),
    (codecs.BOM_UTF16_LE, "is UTF-16 text; save it as UTF-8"),
    (codecs.BOM_UTF16_BE, "is UTF-16 text; save it as UTF-8"),
)


def read_text(path: Path) -> str:
    """The file's text, decoded as UTF-8 without a byte-order mark."""
    if path.is_dir():
        raise InputFileError(path, "is a folder, not a file; pass the file itself")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputFileError(path, "no such file") from None
    except OSError as e:
        raise InputFileError(path, f"cannot be read: {e.strerror or e}") from None
    for magic, what in _SIGNATURES:
        if data.startswith(magic):
            raise InputFileError(path, what)
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = start + e.start
        line = data.count(b"\n", 0, at) + 1
        raise InputFileError(
            path,
            f"is not UTF-8 text (byte 0x{data[at]:02x} at offset {at:,}); a binary file or "
            "another encoding? Save it as UTF-8",
            line,
        ) from None
    nul = text.find("\0")
    if nul >= 0:
        raise InputFileError(
            path, "holds a NUL byte: a binary file, not text", text.count("\n", 0, nul) + 1
        )
    return text
