"""The HTTP side of the served engine: an asyncio event loop in a background thread, one
aiohttp session with a bounded connection pool, one task per request streaming its
completion, and a task scraping ``/metrics``. Tasks put what they see on a queue that the
harness thread drains at each step, so the synchronous harness never waits on the network.

Every streamed event is stamped with ``time.perf_counter()`` as it is read, as ``vllm bench
serve`` stamps them: TTFT, ITL, TPOT and E2EL come from these stamps. A request
ends at its last token chunk (the usage chunk and ``[DONE]`` follow it).

A request never raises: an HTTP status other than 200, an error event in the stream, a
malformed reply (:mod:`kvbench.engines.external.openai.reply`), a refused redirect, a timeout or a
lost connection ends it with a :class:`Failed` event saying why, scrubbed of secrets. After
a lost connection the task asks whether the server is still there, so the engine can tell
a dropped request from a server that died. ``/metrics`` pages are read up to a cap and
parsed in a worker thread, so a large page never holds the loop that stamps tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import statistics
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from kvbench.engines.external.openai.redirects import RedirectPolicy, RedirectRefused, follow
from kvbench.engines.external.openai.reply import (
    ERROR_BODY_BYTES,
    Ask,
    BadReply,
    Reply,
    SseReader,
    Usage,
    read_body,
    read_head,
)
from kvbench.engines.external.openai.scrub import scrub
from kvbench.engines.external.openai.server_metrics import (
    MAX_PAGE_BYTES,
    MetricsError,
    ServerSample,
    parse_metrics,
)

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
# Of an error body, this much is kept in the request's reason; of any reason, the second.
REASON_CHARS = 300
MAX_REASON_CHARS = 1000
_JSON = {"Content-Type": "application/json"}


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
    """The stream ended; ``t`` is its last token chunk's time, ``usage`` the server's counts,
    ``counts`` the tokens streamed per sample."""

    rid: str
    t: float
    usage: Usage | None
    counts: tuple[int, ...]


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
    api_key: str | None  # sent as a bearer token; scrubbed from all that is kept
    allow_other_hosts: bool  # follow redirects to other hosts
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
    # Readings per field whose value was non-finite or absurd (absent in those readings).
    dropped: Counter[str] = field(default_factory=Counter)

    def add(self, scrape: Scrape) -> None:
        self.count += 1
        self.total_s += scrape.duration_s
        self.recent_s = [*self.recent_s[-(RECENT_SCRAPES - 1):], scrape.duration_s]
        self.max_s = max(self.max_s, scrape.duration_s)
        if scrape.sample is None:
            self.failed += 1
            self.last_error = scrape.error
        else:
            self.dropped.update(scrape.sample.dropped)

    def to_json(self) -> dict[str, Any]:
        mean = self.total_s / self.count if self.count else None
        return {
            "count": self.count, "failed": self.failed,
            "mean_ms": None if mean is None else 1000 * mean, "max_ms": 1000 * self.max_s,
            "longest_interval_ms": 1000 * self.longest_interval_s,
            "last_error": self.last_error, "values_dropped": dict(self.dropped),
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
    redirects: RedirectPolicy
    # /metrics pages are parsed here, off the loop that stamps streamed tokens.
    parser: ThreadPoolExecutor
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    streams: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    cost: ScrapeCost = field(default_factory=ScrapeCost)

    @classmethod
    async def open(cls, config: ClientConfig, events: queue.SimpleQueue[Event]) -> Client:
        connector = aiohttp.TCPConnector(
            limit=config.max_connections, limit_per_host=config.max_connections,
            keepalive_timeout=60, enable_cleanup_closed=True,
        )
        # trust_env=False: no proxy from the environment stands between client and server.
        session = aiohttp.ClientSession(
            connector=connector, trust_env=False,
            timeout=aiohttp.ClientTimeout(total=config.request_timeout_s),
        )
        parser = ThreadPoolExecutor(1, thread_name_prefix="kvbench-metrics")
        return cls(config, events, session, RedirectPolicy(config.allow_other_hosts), parser)

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.session.close()
        self.parser.shutdown(wait=False, cancel_futures=True)

    def scrub(self, text: str) -> str:
        return scrub(text, self.config.api_key)

    def _auth(self) -> dict[str, str]:
        key = self.config.api_key
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    # -- requests -------------------------------------------------------------------------

    def send(self, rid: str, path: str, body: bytes, ask: Ask) -> None:
        task = self.spawn(self._stream(rid, path, body, ask))
        self.streams[rid] = task
        task.add_done_callback(lambda _: self.streams.pop(rid, None))

    def cancel(self, rids: list[str]) -> None:
        """Stop the given requests' streams (the engine has already failed them)."""
        for rid in rids:
            task = self.streams.pop(rid, None)
            if task is not None:
                task.cancel()

    async def _stream(self, rid: str, path: str, body: bytes, ask: Ask) -> None:
        self.events.put(Sent(rid, time.perf_counter()))
        gone = False
        try:
            reason = await self._exchange(rid, self.config.base_url + path, body, ask)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            reason = f"timeout after {self.config.request_timeout_s:g} s"
        except (BadReply, RedirectRefused) as exc:
            reason = str(exc)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            reason = f"connection lost: {type(exc).__name__}: {exc}"
            gone = not await self.alive()
        except Exception as exc:  # whatever else a server's reply breaks fails only its request
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            reason = self.scrub(reason)[:MAX_REASON_CHARS]
            self.events.put(Failed(rid, time.perf_counter(), reason, gone))

    async def _exchange(self, rid: str, url: str, body: bytes, ask: Ask) -> str | None:
        """Stream one completion, putting its chunks and end on the queue; returns why it
        failed, if it did before its end."""
        put = self.events.put
        last = time.perf_counter()
        async with follow(self.session, "POST", url, self.redirects, auth=self._auth(),
                          headers=_JSON, data=body) as resp:
            if resp.status != 200:
                detail = (await read_head(resp, ERROR_BODY_BYTES)).decode(errors="replace")
                # Scrubbed before it is cut: a cut could keep part of a key.
                detail = self.scrub(detail).strip()[:REASON_CHARS]
                return f"HTTP {resp.status} {str(resp.reason)[:REASON_CHARS]}: {detail}"
            reply, sse = Reply(ask), SseReader()
            async for data in resp.content.iter_any():
                for message in sse.feed(data):
                    # Each event its own stamp, as bench serve takes them: chunks that arrive
                    # together still count as separate inter-token gaps.
                    t = time.perf_counter()
                    for tokens in reply.take(message):
                        put(Chunk(rid, t, tokens.index, tokens.count, tokens.ids))
                        last = t
                    if reply.done:
                        break
                if reply.done:
                    break
            else:  # the stream ended: its last event may lack the blank line after it
                for message in sse.finish():
                    reply.take(message)
            if not reply.done:
                return "stream ended before [DONE]"
            put(Done(rid, last, reply.usage, tuple(reply.counts)))
        return None

    async def alive(self) -> bool:
        """Whether the server still answers its model list."""
        try:
            async with self.session.get(
                self.config.base_url + "/models", headers=self._auth(), allow_redirects=False,
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
            text = await self._metrics_page(self.config.metrics_url)
            sample = await asyncio.get_running_loop().run_in_executor(
                self.parser, parse_metrics, text)
        except Exception as exc:  # any failure is a failed reading, never a stopped scraper
            error = self.scrub(f"{type(exc).__name__}: {exc}")[:MAX_REASON_CHARS]
            return Scrape(t0, time.perf_counter() - t0, None, error)
        return Scrape(t0, time.perf_counter() - t0, sample)

    async def _metrics_page(self, url: str) -> str:
        timeout = aiohttp.ClientTimeout(
            total=max(SCRAPE_TIMEOUT_FLOOR_S, 10 * self.config.scrape_interval_s))
        async with follow(self.session, "GET", url, self.redirects, auth=self._auth(),
                          timeout=timeout) as resp:
            if resp.status != 200:
                raise MetricsError(f"HTTP {resp.status} {resp.reason}")
            return (await read_body(resp, MAX_PAGE_BYTES)).decode(errors="replace")

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


async def fetch_text(
    url: str, auth: dict[str, str], timeout_s: float, policy: RedirectPolicy
) -> tuple[int, str]:
    """One GET outside a run (server discovery): status and body (at most a /metrics
    page's size)."""
    async with aiohttp.ClientSession(trust_env=False) as session, \
            follow(session, "GET", url, policy, auth=auth,
                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, (await read_body(resp, MAX_PAGE_BYTES)).decode(errors="replace")


def run_sync(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code (no loop is running here)."""
    return asyncio.run(coro_fn())
