"""Parsing and formatting of byte sizes ("64MiB", "1.5GB") and SLO-style lists, and the
close match offered for a misspelt name."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

from kvbench.errors import KvbenchError

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """Parse a byte size such as ``64MiB`` or ``1.5GB`` (an int counts bytes); ``what``
    names the value in messages, e.g. ``--kv-memory``.

    Text needs a unit: a bare ``1`` is far likelier a slip for 1 GiB than a budget of
    one byte."""
    shown = text if isinstance(text, int) or (text and text.strip() == text) else repr(text)
    if isinstance(text, int):
        value, unit = float(text), "b"
    else:
        m = _SIZE_RE.match(text)
        if m and not m.group(2) and float(m.group(1)) > 0:
            number = m.group(1)
            # Below 1024 a byte count is no plausible size; above, bytes may be meant.
            big, small = ("B", "MiB") if float(number) >= 1024 else ("GiB", "MiB")
            raise KvbenchError(
                f"{what} {shown}: a size needs a unit, e.g. {number}{big} or {number}{small}"
            )
        if not m or m.group(2).lower() not in {*_UNITS, ""}:
            raise KvbenchError(
                f"{what} {shown}: cannot read this size: write a number and a unit, "
                "e.g. 64MiB, 2GiB, 500MB or 1048576B"
            )
        value, unit = float(m.group(1)), m.group(2).lower() or "b"
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise KvbenchError(f"{what} {shown} must be positive")
    return size


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """``"did you mean 'paged'? "`` for the closest of ``valid`` to a misspelt ``name``,
    or ``""`` when none is close; messages put it before the list of valid names."""
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def format_bytes(n: float | None) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
