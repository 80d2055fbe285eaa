"""A live OpenAI-compatible server behind the Engine protocol.

The harness adds each request at its arrival time under the wall clock; ``add`` hands it to
the client's event loop, which streams it from the server. A step waits at most
``POLL_S`` for something to happen (so the harness adds the next arrival at most that
late), then reports what arrived since the last step: tokens, with the exact time each
chunk came (``StepReport.stamps``), completions and failures. A request's latencies count
from when it was sent, as ``vllm bench serve`` counts them (the record's ``arrival_s`` is
that time; ``observed.send_lag_ms`` says how long the client took to send after the harness
added it). Queue sizes, preemptions and KV memory come from the latest ``/metrics`` scrape
(every ``scrape_interval_ms``, at most ``scrape_max_duty`` of the server's time), through
:mod:`kvbench.engines.external.openai.server_metrics`; when the server publishes none, running is
the number of requests in flight and KV is absent.

Each completion's usage counts are checked against the workload (prompt tokens where the
prompt was sent as token ids, output tokens always) and mismatches are counted in the
record. Generation is forced to the workload's length, so a reply of any other length (per
sample, or in the server's own ``completion_tokens``), or of no tokens at all, is a failed
request, as is an HTTP error, a malformed reply, a timeout or a lost connection; each is
reported with its reason. A lost connection after which the server no longer answers, or
the run passing ``run_timeout_s``, fails the run (completed requests are kept).

What a server does not publish stays absent: used (written) KV bytes, shared bytes, block
allocations and frees, per-request preemptions and queue times, and batch shapes.
"""

from __future__ import annotations

import dataclasses
import gc
import queue
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbench.engines.base import (
    Engine,
    Finished,
    KVStats,
    Stamps,
    StepReport,
    output_digest,
)
from kvbench.engines.config import EngineConfig
from kvbench.engines.external.openai.client import (
    Chunk,
    Client,
    ClientConfig,
    Done,
    Event,
    Failed,
    LoopThread,
    Scrape,
    Sent,
)
from kvbench.engines.external.openai.discovery import ServerInfo, api_key
from kvbench.engines.external.openai.payload import PromptFormat, build_payload
from kvbench.engines.external.openai.reply import Ask
from kvbench.engines.external.openai.scrub import scrub
from kvbench.engines.external.openai.section import OpenAISection, served_rejection
from kvbench.engines.external.openai.server_metrics import ServerKV
from kvbench.workloads.model import Request

# How long a step waits for an event: the most the harness can be late adding an arrival.
POLL_S = 0.001
_SETUP_TIMEOUT_S = 30.0
ABSENT_KV_FIELDS = (
    "used_bytes", "reserved_ahead_bytes", "shared_bytes", "block_allocs", "block_frees",
    "copied_bytes", "page_table_entries", "evictions",
)
NOT_OBSERVED = (
    "batch shapes (num_tokens per step)", "per-request preemptions", "per-request queue time",
)


@dataclass(slots=True)
class _InFlight:
    request: Request
    expected_prompt: int | None  # the prompt's token count, where sent as token ids
    added_s: float  # perf_counter() when the harness added it
    samples: dict[int, list[int]] = field(default_factory=dict)
    tokens: int = 0
    ids_known: bool = True


@dataclass(slots=True)
class _Observed:
    """What the run saw, for the record."""

    apis: Counter[str] = field(default_factory=Counter)
    prompt_formats: Counter[str] = field(default_factory=Counter)
    images: int = 0
    placeholders: int = 0
    checked: int = 0
    usage_missing: int = 0
    prompt_mismatch: int = 0
    output_mismatch: int = 0
    stream_mismatch: int = 0  # tokens streamed differ from the server's own count
    errors: Counter[str] = field(default_factory=Counter)
    peak_in_flight: int = 0
    # From the harness adding a request to the client sending it (the event loop's delay).
    send_lag_s: list[float] = field(default_factory=list)

    def to_json(self, max_connections: int) -> dict[str, Any]:
        return {
            "requests": {"api": dict(self.apis), "prompt_format": dict(self.prompt_formats),
                         "images_sent": self.images,
                         "multimodal_placeholders": self.placeholders},
            "usage_check": {
                "checked": self.checked, "usage_missing": self.usage_missing,
                "prompt_token_mismatches": self.prompt_mismatch,
                "output_token_mismatches": self.output_mismatch,
                "streamed_token_mismatches": self.stream_mismatch,
            },
            "errors": dict(self.errors),
            "send_lag_ms": _lag_ms(self.send_lag_s),
            "peak_in_flight": self.peak_in_flight,
            # Requests beyond the pool wait in the client: their latency includes the wait.
            "client_queued": self.peak_in_flight > max_connections,
        }


def _lag_ms(lags_s: list[float]) -> dict[str, float] | None:
    if not lags_s:
        return None
    ms = np.asarray(lags_s) * 1000.0
    return {"median": float(np.median(ms)), "p99": float(np.percentile(ms, 99)),
            "max": float(ms.max())}


class OpenAIEngine(Engine):
    """Drives a live server; see the module docstring."""

    def __init__(self, config: EngineConfig, section: OpenAISection, info: ServerInfo) -> None:
        self.name = config.name
        self.section = section
        self.info = info
        self.vocab_size = config.preset.vocab_size
        self.bytes_per_token = config.preset.kv_bytes_per_token
        self.prompt_format: PromptFormat = (
            section.prompt_format if section.prompt_format != "auto" else self._auto_format()
        )
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._inflight: dict[str, _InFlight] = {}
        # Requests ended without being sent (rejected, or past the deadline): the next step's.
        self._ended: list[Finished] = []
        self._fatal: str | None = None
        self._api_key = api_key(section)
        self._deadline: float | None = None  # perf_counter() when the run must end
        self._observed = _Observed()
        # Whether a reading after the last drain is still to come (see has_unfinished), and
        # whether it is yet to be asked for: at the next step, if nothing was added since.
        self._awaiting_drain = False
        self._drain_due = False
        sample = info.sample
        self._kv = ServerKV.of(sample, self.bytes_per_token) if sample is not None else None
        self._base = sample
        self._latest = sample
        self._kv_now: KVStats | None = None
        self._preempted_pending = 0
        # A collection of the whole heap (torch and the rest of this process) stops every
        # thread for up to hundreds of milliseconds, delaying the stamps of streamed chunks;
        # freezing what exists now keeps the run's collections to the run's own objects.
        gc.collect()
        gc.freeze()
        self._loop = LoopThread()
        try:
            self._client = self._loop.run(Client.open(self._client_config(), self._events),
                                          _SETUP_TIMEOUT_S)
            if info.metrics_url is not None:
                # The run's counters (prefix hits, preemptions) start from this reading.
                first = self._loop.run(self._client.scrape(), _SETUP_TIMEOUT_S)
                if first.sample is not None:
                    self._base = first.sample
                self._on_scrape(first)
                self._loop.loop.call_soon_threadsafe(self._client.start_scraping)
        except BaseException:
            self._loop.close()
            gc.unfreeze()
            raise

    def _auto_format(self) -> PromptFormat:
        """Token ids where the server is known to take them: vLLM (which answers /version)
        and SGLang."""
        known = self.info.version is not None or (
            self.info.sample is not None and self.info.sample.flavor != "unknown"
        )
        return "token_ids" if known else "text"

    def _client_config(self) -> ClientConfig:
        s = self.section
        return ClientConfig(
            base_url=s.endpoint, metrics_url=self.info.metrics_url, api_key=self._api_key,
            allow_other_hosts=s.allow_redirects_to_other_hosts,
            max_connections=s.max_connections, request_timeout_s=s.request_timeout_s,
            scrape_interval_s=s.scrape_interval_ms / 1000.0, scrape_max_duty=s.scrape_max_duty,
        )

    # -- Engine protocol ------------------------------------------------------------------

    def add(self, request: Request) -> None:
        reason = served_rejection(self.info.max_model_len, request)
        if reason is not None:
            self._ended.append(Finished(request.id, rejected=reason))
            return
        now = time.perf_counter()
        timeout_s = self.section.run_timeout_s
        if self._deadline is None and timeout_s is not None:
            self._deadline = now + timeout_s
        if self._deadline is not None and now >= self._deadline:
            self._ended.append(Finished(request.id, error=f"not sent: {self._late()}"))
            self._fatal = self._fatal or self._deadline_passed(0)
            return
        payload = build_payload(
            request, model=self.info.model, vocab_size=self.vocab_size,
            prompt_format=self.prompt_format, images=self.section.multimodal == "images",
            chat=self.section.chat,
        )
        obs = self._observed
        obs.apis[payload.api] += 1
        obs.prompt_formats[payload.prompt_format] += 1
        obs.images += payload.images
        obs.placeholders += payload.placeholders
        exact = payload.api == "completions" and payload.prompt_format == "token_ids"
        self._inflight[request.id] = _InFlight(
            request, request.prompt_tokens if exact else None, now
        )
        obs.peak_in_flight = max(obs.peak_in_flight, len(self._inflight))
        path = "/completions" if payload.api == "completions" else "/chat/completions"
        ask = Ask(request.n, request.output_tokens)
        self._loop.loop.call_soon_threadsafe(self._client.send, request.id, path, payload.body,
                                             ask)

    def has_unfinished(self) -> bool:
        # A pending fatal error is raised by the next step, after this one's results. Once
        # nothing is in flight, the run holds until a /metrics reading taken after the
        # drain has come: the KV a wave or the run ends with is then the drained server's.
        return bool(self._inflight or self._ended or self._fatal or self._awaiting_drain)

    def step(self) -> StepReport:
        if self._fatal is not None:
            raise RuntimeError(self._fatal)
        report = StepReport(finished=self._ended, stamps=Stamps())
        self._ended = []
        if self._drain_due:
            # The client emptied at the last step. Read /metrics drained only if the harness
            # added nothing since: a harness holding requests back (max_concurrency) sends
            # the next one straight away, and a reading then would cost the server time
            # while it serves that request.
            self._drain_due = False
            if self._inflight:
                self._awaiting_drain = False
            else:
                self._loop.loop.call_soon_threadsafe(self._client.scrape_drained)
        had_inflight = bool(self._inflight)
        for event in self._take_events(wait=not report.finished):
            self._apply(event, report)
        self._expire(report)
        if had_inflight and not self._inflight and self.info.metrics_url is not None:
            self._awaiting_drain = self._drain_due = True
        sample = self._latest
        if sample is not None and sample.running is not None:
            report.num_running = round(sample.running)
            report.num_waiting = round(sample.waiting or 0)
        else:
            report.num_running = len(self._inflight)
        report.num_preempted, self._preempted_pending = self._preempted_pending, 0
        report.kv = self._kv_now
        return report

    def close(self) -> None:
        if self._loop.loop.is_running():
            try:
                self._loop.run(self._client.close(), _SETUP_TIMEOUT_S)
            finally:
                self._loop.close()
                gc.unfreeze()

    def describe(self) -> dict[str, Any]:
        s, info = self.section, self.info
        kv = self._kv
        out: dict[str, Any] = {
            "engine": "openai",
            "endpoint": s.endpoint,
            "served_model": scrub(info.model, self._api_key),
            "api_key_env": s.api_key_env,
            "server": {
                "flavor": info.sample.flavor if info.sample is not None else "unknown",
                "version": info.version, "max_model_len": info.max_model_len,
            },
            "prompt_format": self.prompt_format,
            "multimodal": s.multimodal,
            "server_metrics": {
                "url": info.metrics_url, "status": info.metrics_status,
                "scrape_interval_ms": s.scrape_interval_ms,
                "published": info.sample.present() if info.sample is not None else [],
            },
            "bytes_per_token": self.bytes_per_token,
            "kv_capacity_bytes": kv.capacity_bytes if kv is not None else None,
            "num_blocks": info.sample.capacity_blocks if info.sample is not None else None,
            "block_size": info.sample.block_size if info.sample is not None else None,
            "max_connections": s.max_connections,
            "request_timeout_s": s.request_timeout_s,
            "run_timeout_s": s.run_timeout_s,
            "kv_stats_absent": list(ABSENT_KV_FIELDS),
            "not_observed": list(NOT_OBSERVED),
            "warnings": list(info.warnings),
        }
        if info.redirects:
            # Where discovery's requests were redirected to (first URL -> last).
            out["server"]["redirects"] = dict(info.redirects)
        if sum(self._observed.apis.values()):
            # Learned while running (the harness adds keys it did not have at the start).
            out["observed"] = self._observed.to_json(s.max_connections)
            out["observed"]["redirects"] = {
                url: self._client.scrub(to) for url, to in self._client.redirects.followed.items()
            }
            cost = self._client.cost
            out["scrapes"] = {**cost.to_json(), "throttled": cost.throttled(
                self.section.scrape_interval_ms / 1000.0, self.section.scrape_max_duty)}
            out["server_counters"] = self._counters()
        return out

    # -- events ---------------------------------------------------------------------------

    def _take_events(self, wait: bool) -> list[Event]:
        events: list[Event] = []
        try:
            events.append(self._events.get(timeout=POLL_S) if wait else self._events.get_nowait())
            while True:
                events.append(self._events.get_nowait())
        except queue.Empty:
            return events

    def _apply(self, event: Event, report: StepReport) -> None:
        if isinstance(event, Scrape):
            self._on_scrape(event)
            return
        state = self._inflight.get(event.rid)
        if state is None:
            return
        stamps = report.stamps
        assert stamps is not None
        rid = event.rid
        if isinstance(event, Sent):
            stamps.sent[rid] = event.t
            self._observed.send_lag_s.append(event.t - state.added_s)
            return
        if isinstance(event, Chunk):
            if state.tokens == 0:
                report.first_token.add(rid)
            state.tokens += event.tokens
            report.tokens[rid] = report.tokens.get(rid, 0) + event.tokens
            stamps.tokens.setdefault(rid, []).extend([event.t] * event.tokens)
            if event.ids is None:
                state.ids_known = False
            else:
                state.samples.setdefault(event.index, []).extend(event.ids)
            return
        del self._inflight[rid]
        if isinstance(event, Failed):
            self._fail(report, rid, event.reason)
            if event.server_gone:
                self._fatal = (
                    f"the server at {self.section.endpoint} stopped answering mid-run "
                    f"({event.reason})"
                )
            return
        assert isinstance(event, Done)
        error = self._check_usage(state, event)
        if error is not None:
            self._fail(report, rid, error)
            return
        digest = None
        if state.ids_known and state.samples:
            digest = output_digest([state.samples[i] for i in sorted(state.samples)])
        cached = event.usage.cached_tokens if event.usage is not None else None
        report.finished.append(Finished(rid, output_digest=digest, cached_tokens=cached))
        stamps.finished[rid] = event.t

    def _fail(self, report: StepReport, rid: str, reason: str) -> None:
        report.finished.append(Finished(rid, error=reason))
        self._observed.errors[reason.split(":", 1)[0]] += 1

    def _check_usage(self, state: _InFlight, done: Done) -> str | None:
        """Count mismatches between the server's usage and the workload; returns why the
        reply is no completion of the forced length, if it is not."""
        obs = self._observed
        obs.checked += 1
        usage = done.usage
        request = state.request
        expected_out = request.output_tokens * request.n
        if state.tokens != expected_out:
            obs.output_mismatch += 1
        completion = None
        if usage is None:
            obs.usage_missing += 1
        else:
            completion = usage.completion_tokens
            if completion != state.tokens:
                obs.stream_mismatch += 1
            expected_prompt = state.expected_prompt
            if expected_prompt is not None and usage.prompt_tokens != expected_prompt:
                obs.prompt_mismatch += 1
        if state.tokens == 0:
            return "wrong length: the reply carried no tokens"
        if any(count != request.output_tokens for count in done.counts):
            return (f"wrong length: {'+'.join(map(str, done.counts))} tokens streamed for "
                    f"{request.n} x max_tokens {request.output_tokens} with ignore_eos")
        if completion is not None and completion != expected_out:
            return (f"wrong length: the server's usage counts {completion} completion tokens, "
                    f"{expected_out} were streamed")
        return None

    def _expire(self, report: StepReport) -> None:
        """Past the run's deadline: fail what is still in flight and end the run."""
        if self._deadline is None or not self._inflight or time.perf_counter() < self._deadline:
            return
        rids = list(self._inflight)
        self._inflight.clear()
        self._loop.loop.call_soon_threadsafe(self._client.cancel, rids)
        for rid in rids:
            self._fail(report, rid, f"run timeout: {self._late()}")
        self._fatal = self._fatal or self._deadline_passed(len(rids))

    def _late(self) -> str:
        return f"the run passed run_timeout_s = {self.section.run_timeout_s:g} s"

    def _deadline_passed(self, cut: int) -> str:
        return (f"{self._late()}: {cut} request{'' if cut == 1 else 's'} in flight failed and "
                "later ones were not sent; what completed is kept")

    def _on_scrape(self, scrape: Scrape) -> None:
        if scrape.drained:
            self._awaiting_drain = False
        sample = scrape.sample
        if sample is None or self._kv is None or self._base is None:
            return
        previous = self._latest
        if sample.dropped and previous is not None:
            # A value dropped from this reading keeps the last one read, as between readings.
            sample = dataclasses.replace(
                sample, **{name: getattr(previous, name) for name in sample.dropped})
        if (sample.preemptions is not None and previous is not None
                and previous.preemptions is not None):
            self._preempted_pending += max(0, round(sample.preemptions - previous.preemptions))
        self._latest = sample
        self._kv_now = self._kv.stats(sample, self._base)

    def _counters(self) -> dict[str, float | None]:
        """The server's counters over the run and its last gauges not in KVStats."""
        latest, base = self._latest, self._base
        if latest is None or base is None:
            return {}
        out: dict[str, float | None] = {}
        for name in ("preemptions", "prefix_queries", "prefix_hits", "mm_cache_queries",
                     "mm_cache_hits"):
            now, start = getattr(latest, name), getattr(base, name)
            out[name] = None if now is None or start is None else now - start
        out["cache_hit_rate"] = latest.cache_hit_rate
        return out

