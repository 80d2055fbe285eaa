"""Readable messages from pydantic validation errors."""

from __future__ import annotations

from pydantic import ValidationError


def validation_message(err: ValidationError) -> str:
    """One ``field.path: problem`` clause per error, joined with ``; ``."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
