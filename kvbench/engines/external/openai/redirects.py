"""HTTP redirects followed by hand: one to another host (name or port) is refused unless the
suite allows it, the API key goes only to the host it was meant for, and the URL a redirect
ended at is kept for the record."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5


class RedirectRefused(Exception):
    """A redirect not followed; the message is the reason recorded."""


@dataclass(slots=True)
class RedirectPolicy:
    """Whether redirects may lead to other hosts, and those followed (first URL -> last)."""

    other_hosts: bool
    followed: dict[str, str] = field(default_factory=dict)


def same_host(a: URL, b: URL) -> bool:
    return (a.host or "").lower() == (b.host or "").lower() and a.port == b.port


@asynccontextmanager
async def follow(
    session: aiohttp.ClientSession, method: str, url: str, policy: RedirectPolicy, *,
    auth: dict[str, str], headers: dict[str, str] | None = None, data: bytes | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
) -> AsyncIterator[aiohttp.ClientResponse]:
    """The response to ``method url`` after the redirects ``policy`` allows; ``auth``
    headers go only to ``url``'s host."""
    start = target = URL(url)
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    for _ in range(MAX_REDIRECTS + 1):
        sent = {**(headers or {}), **(auth if same_host(target, start) else {})}
        resp = await session.request(method, target, data=data, headers=sent,
                                     allow_redirects=False, **extra)
        location = resp.headers.get("Location")
        if resp.status not in REDIRECT_STATUSES or location is None:
            break
        resp.release()
        target_next = _resolve(target, location)
        if not policy.other_hosts and not same_host(target_next, start):
            raise RedirectRefused(
                f"redirect refused: {start} redirected to another host ({target_next}); set "
                "allow_redirects_to_other_hosts = true in the engine's section to follow it"
            )
        if resp.status == 303 or (resp.status in (301, 302) and method == "POST"):
            method, data = "GET", None  # as browsers and aiohttp follow these
        target = target_next
    else:
        raise RedirectRefused(f"redirect refused: more than {MAX_REDIRECTS} redirects from {start}")
    if target != start:
        policy.followed[str(start)] = str(target)
    try:
        yield resp
    finally:
        resp.release()


def _resolve(current: URL, location: str) -> URL:
    try:
        target = current.join(URL(location))
    except ValueError:
        target = None
    if target is None or target.scheme not in ("http", "https") or not target.host:
        raise RedirectRefused(f"redirect refused: {current} redirected to {location[:200]!r}, "
                              "not an http(s) URL")
    return target
