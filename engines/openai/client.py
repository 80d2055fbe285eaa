"""The HTTP side of the served engine: an asyncio event loop in a background thread, one
aiohttp session with a bounded connection pool, one task per request streaming its
completion, and a task scraping ``/metrics``. Tasks put what they see on a queue that the
harness thread drains at each step, so the synchronous harness never waits on the network.

Every streamed event is stamped with ``time.perf_counter()`` as it is read, as ``vllm bench
serve`` stamps them: TTFT, ITL, TPOT and E2EL come from these stamps. A request
ends at its last token chunk (the usage chunk and ``[DONE]`` follow it).

A request never raises: an HTTP status other than 200, an error event in the stream, a
timeout or a lost connection ends it with a :class:`Failed` event saying why. After a lost
connection the task asks whether the server is still there, so the engine can tell a
dropped request from a server that died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from kvbench.engines.openai.server_metrics import ServerSample, parse_metrics

T = TypeVar("T")
# How long to wait for an answer about whether the server is still up.
ALIVE_TIMEOUT_S = 3.0
# After a drain, how often to re-read /metrics until the server shows no requests (its
# gauges may lag the last streamed token by an engine step), and how long between reads.
DRAIN_SCRAPES = 10
DRAIN_WAIT_S = 0.02
# Readings whose median cost spaces the next ones (see ScrapeCost.typical_s).
RECENT_SCRAPES = 5
# A /metrics page rendered late (a server busy streaming answers it after its other work) is
# still a reading: only one this late, or a server not answering, counts as failed.
SCRAPE_TIMEOUT_FLOOR_S = 5.0


@dataclass(frozen=True, slots=True)
class Sent:
    """The request left for the server at ``t``."""

    rid: str
    t: float


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one choice (sample ``index``) that arrived at ``t``."""

    rid: str
    t: float
    index: int
    tokens: int
    ids: list[int] | None


@dataclass(frozen=True, slots=True)
class Done:
    """The stream ended; ``t`` is its last token chunk's time, ``usage`` the server's counts."""

    rid: str
    t: float
    usage: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Failed:
    rid: str
    t: float
    reason: str
    server_gone: bool = False  # the connection was lost and the server no longer answers


@dataclass(frozen=True, slots=True)
class Scrape:
    """One ``/metrics`` reading: its start time, cost, and the sample or the error;
    ``drained`` marks the reading taken after the client had nothing in flight."""

    t: float
    duration_s: float
    sample: ServerSample | None
    error: str | None = None
    drained: bool = False


Event = Sent | Chunk | Done | Failed | Scrape


class LoopThread:
    """An event loop running in a daemon thread; coroutines are handed to it from others."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kvbench-openai", daemon=True
        )
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return self.submit(coro).result(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        if not self.loop.is_running():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass(slots=True)
class ClientConfig:
    base_url: str  # the endpoint, ending in /v1
    metrics_url: str | None
    headers: dict[str, str]
    max_connections: int
    request_timeout_s: float
    scrape_interval_s: float
    # The most of the server's time its /metrics pages may take (see OpenAISection).
    scrape_max_duty: float


@dataclass(slots=True)
class ScrapeCost:
    """What scraping cost: readings taken, failed, and their durations."""

    count: int = 0
    failed: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    last_error: str | None = None
    longest_interval_s: float = 0.0  # the interval the duty cap stretched the reads to
    recent_s: list[float] = field(default_factory=list)  # the last few durations

    def add(self, scrape: Scrape) -> None:
        self.count += 1
        self.total_s += scrape.duration_s
        self.recent_s = [*self.recent_s[-(RECENT_SCRAPES - 1):], scrape.duration_s]
        self.max_s = max(self.max_s, scrape.duration_s)
        if scrape.sample is None:
            self.failed += 1
            self.last_error = scrape.error

    def to_json(self) -> dict[str, Any]:
        mean = self.total_s / self.count if self.count else None
        return {
            "count": self.count, "failed": self.failed,
            "mean_ms": None if mean is None else 1000 * mean, "max_ms": 1000 * self.max_s,
            "longest_interval_ms": 1000 * self.longest_interval_s,
            "last_error": self.last_error,
        }

    def typical_s(self) -> float:
        """A reading's usual cost: the median of the last few, so that one slow reading
        (the server busy for a moment) does not stall the next ones for seconds."""
        return statistics.median(self.recent_s) if self.recent_s else 0.0

    def throttled(self, interval_s: float, max_duty: float) -> str | None:
        """Why readings were further apart than ``interval_s``, if they were."""
        if self.longest_interval_s <= 1.01 * interval_s:
            return None
        return (
            f"scrape-throttled: /metrics took the server up to {1000 * self.max_s:.0f} ms to "
            f"render (typically {1000 * self.typical_s():.0f} ms), so it was read as seldom as "
            f"every {1000 * self.longest_interval_s:.0f} "
            f"ms instead of {1000 * interval_s:g} ms, keeping its cost under "
            f"{100 * max_duty:g}% of the server's time (scrape_max_duty)"
        )


@dataclass(slots=True)
class Client:
    """The session, its tasks and the event queue (all used from the loop thread)."""

    config: ClientConfig
    events: queue.SimpleQueue[Event]
    session: aiohttp.ClientSession
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    cost: ScrapeCost = field(default_factory=ScrapeCost)

    @classmethod
    async def open(cls, config: ClientConfig, events: queue.SimpleQueue[Event]) -> Client:
        connector = aiohttp.TCPConnector(
            limit=config.max_connections, limit_per_host=config.max_connections,
            keepalive_timeout=60, enable_cleanup_closed=True,
        )
        # trust_env=False: no proxy from the environment stands between client and server.
        session = aiohttp.ClientSession(
            connector=connector, headers=config.headers, trust_env=False,
            timeout=aiohttp.ClientTimeout(total=config.request_timeout_s),
        )
        return cls(config, events, session)

    def spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()

    # -- requests -------------------------------------------------------------------------

    def send(self, rid: str, path: str, body: bytes) -> None:
        self.spawn(self._stream(rid, path, body))

    async def _stream(self, rid: str, path: str, body: bytes) -> None:
        put = self.events.put
        url = self.config.base_url + path
        last = time.perf_counter()
        put(Sent(rid, last))
        try:
            async with self.session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:300].strip()
                    put(Failed(rid, time.perf_counter(), f"HTTP {resp.status} {resp.reason}: "
                               f"{detail}"))
                    return
                usage, done, buf = None, False, b""
                async for data in resp.content.iter_any():
                    buf += data
                    *messages, buf = buf.split(b"\n\n")
                    for message in messages:
                        # Each event its own stamp, as bench serve takes them: chunks that
                        # arrive together still count as separate inter-token gaps.
                        t = time.perf_counter()
                        payload = _sse_data(message)
                        if payload is None:
                            continue
                        if payload == "[DONE]":
                            done = True
                            break
                        obj = json.loads(payload)
                        if obj.get("error"):
                            put(Failed(rid, t, f"error event: {_error_text(obj['error'])}"))
                            return
                        usage = obj.get("usage") or usage
                        for choice in obj.get("choices") or ():
                            count, ids = _choice_tokens(choice)
                            if count:
                                put(Chunk(rid, t, int(choice.get("index", 0)), count, ids))
                                last = t
                if not done:
                    put(Failed(rid, time.perf_counter(), "stream ended before [DONE]"))
                    return
                put(Done(rid, last, usage))
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            put(Failed(rid, time.perf_counter(),
                       f"timeout after {self.config.request_timeout_s:g} s"))
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            reason = f"connection lost: {type(exc).__name__}: {exc}"
            put(Failed(rid, time.perf_counter(), reason, server_gone=not await self.alive()))
        except Exception as exc:  # a malformed stream must not stop the run
            put(Failed(rid, time.perf_counter(), f"{type(exc).__name__}: {exc}"))

    async def alive(self) -> bool:
        """Whether the server still answers its model list."""
        try:
            async with self.session.get(
                self.config.base_url + "/models",
                timeout=aiohttp.ClientTimeout(total=ALIVE_TIMEOUT_S),
            ) as resp:
                return resp.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False

    # -- metrics --------------------------------------------------------------------------

    async def scrape(self) -> Scrape:
        scrape = await self._read_metrics()
        self.cost.add(scrape)
        return scrape

    async def _read_metrics(self) -> Scrape:
        assert self.config.metrics_url is not None
        t0 = time.perf_counter()
        try:
            async with self.session.get(
                self.config.metrics_url,
                timeout=aiohttp.ClientTimeout(
                    total=max(SCRAPE_TIMEOUT_FLOOR_S, 10 * self.config.scrape_interval_s)),
            ) as resp:
                resp.raise_for_status()
                text = await resp.text()
            sample = parse_metrics(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return Scrape(t0, time.perf_counter() - t0, None, f"{type(exc).__name__}: {exc}")
        return Scrape(t0, time.perf_counter() - t0, sample)

    def start_scraping(self) -> None:
        self.spawn(self._scrape_forever())

    async def _scrape_forever(self) -> None:
        due = time.perf_counter()
        while True:
            self.events.put(await self.scrape())
            interval = max(self.config.scrape_interval_s,
                           self.cost.typical_s() / self.config.scrape_max_duty)
            self.cost.longest_interval_s = max(self.cost.longest_interval_s, interval)
            # Behind schedule (a slow server): the next reading starts now, not in a burst.
            due = max(due + interval, time.perf_counter())
            await asyncio.sleep(due - time.perf_counter())

    def scrape_drained(self) -> None:
        """Read /metrics until the server shows nothing running (bounded), then hand the
        reading over marked ``drained``: the KV after a drain is then the server's state
        after it, not before."""
        self.spawn(self._scrape_drained())

    async def _scrape_drained(self) -> None:
        for _ in range(DRAIN_SCRAPES):
            scrape = await self.scrape()
            sample = scrape.sample
            if sample is None or not (sample.running or sample.waiting):
                break
            self.events.put(scrape)
            await asyncio.sleep(DRAIN_WAIT_S)
        self.events.put(dataclasses.replace(scrape, drained=True))


def _sse_data(message: bytes) -> str | None:
    """The data of one server-sent event; None for comments and events without data."""
    lines = [
        line[5:].lstrip() for line in message.decode().splitlines() if line.startswith("data:")
    ]
    return "\n".join(lines) if lines else None


def _choice_tokens(choice: dict[str, Any]) -> tuple[int, list[int] | None]:
    """Tokens a streamed choice carries: its token ids where the server returns them, else
    one per chunk with output (completions text, or chat delta content), as ``vllm bench
    serve`` counts them."""
    ids = choice.get("token_ids")
    if ids is not None:
        return len(ids), list(ids)
    delta = choice.get("delta")
    if delta is not None:  # chat: the first chunk may carry only the role
        return (1 if delta.get("content") else 0), None
    return 1, None


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


async def fetch_text(
    url: str, headers: dict[str, str], timeout_s: float
) -> tuple[int, str]:
    """One GET outside a run (server discovery): status and body."""
    async with aiohttp.ClientSession(headers=headers, trust_env=False) as session, \
            session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, await resp.text()


def run_sync(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code (no loop is running here)."""
    return asyncio.run(coro_fn())
