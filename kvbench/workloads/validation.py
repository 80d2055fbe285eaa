"""Readable messages from pydantic validation errors."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

_NO_DATA = object()


def _key_path(loc: tuple[int | str, ...], data: Any) -> str:
    """``loc`` as the key path a user wrote: ``classes[0].prompt.median``.

    Walking the validated data tells keys from the tags pydantic adds for the member of a
    discriminated union (``prompt.lognormal.median``): a tag is no key of the table it follows.
    """
    out = ""
    node = data
    for part in loc:
        if isinstance(part, int) and isinstance(node, list):
            out += f"[{part}]"
            node = node[part] if part < len(node) else None
        elif isinstance(node, dict) and part in node:
            out += f".{part}" if out else str(part)
            node = node[part]
        elif isinstance(node, dict) and node.get("kind") == part:
            continue  # the union member pydantic tried, named after the table's kind
        else:
            out += f".{part}" if out else str(part)
            node = None
    return out


def validation_message(err: ValidationError, data: Any = _NO_DATA) -> str:
    """One ``field.path: problem`` clause per error, joined with ``; ``.

    Given the validated ``data``, paths are written as keys of that data
    (``classes[0].prompt.median``); otherwise as pydantic's dotted location.
    """
    parts = []
    for e in err.errors():
        if data is _NO_DATA:
            loc = ".".join(str(p) for p in e["loc"])
        else:
            loc = _key_path(tuple(e["loc"]), data)
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
