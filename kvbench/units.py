"""Parsing and formatting of byte sizes ("64MiB", "1.5GB") and SLO-style lists."""

from __future__ import annotations

import re

from kvbench.errors import KvbenchError

_UNITS = {
    "": 1,
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


def parse_bytes(text: str | int) -> int:
    """Parse a byte size such as ``64MiB``, ``1.5GB`` or ``4096``."""
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        m = _SIZE_RE.match(text)
        if not m or m.group(2).lower() not in _UNITS:
            raise KvbenchError(
                f"cannot read size {text!r}: write a number with an optional unit, "
                "e.g. 64MiB, 2GiB, 500MB or 1048576"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise KvbenchError(f"size {text!r} must be positive")
    return size


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
