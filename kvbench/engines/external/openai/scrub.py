"""Secrets out of server text. A careless or hostile server may echo the request's
``Authorization`` header in an error body, an error event or a redirect; everything the
served engine keeps or prints from a server passes through :func:`scrub` first."""

from __future__ import annotations

import json
import re
from urllib.parse import quote

MASK = "***"
# Bearer credentials (any case; RFC 6750's token characters) and OpenAI-style keys,
# whichever key this run holds.
_TOKENS = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9\-._~+/]+=*|\bsk-[A-Za-z0-9_\-]+")


def _mask(match: re.Match[str]) -> str:
    return f"{match.group(1)} {MASK}" if match.group(1) else f"sk-{MASK}"


def scrub(text: str, key: str | None) -> str:
    """``text`` without ``key`` (as sent, JSON-escaped or URL-encoded) and without any
    ``Bearer …`` or ``sk-…`` token."""
    if key:
        # Longest first: one form may contain another.
        for form in sorted({key, json.dumps(key)[1:-1], quote(key, safe="")}, key=len,
                           reverse=True):
            text = text.replace(form, MASK)
    return _TOKENS.sub(_mask, text)
