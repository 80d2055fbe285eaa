"""What a server is, asked before any work starts: that it answers at the endpoint, serves
the model, how long its context is, its version, and whether it publishes Prometheus
metrics kvbench can read. Problems that make a run meaningless fail with what to do;
missing or unreadable telemetry degrades the run with a named warning. Whatever the server
says is scrubbed of secrets (:mod:`kvbench.engines.external.openai.scrub`) before it is kept.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvbench.engines.external.openai.reply import BadReply, is_count
from kvbench.engines.external.openai.scrub import scrub
from kvbench.engines.external.openai.server_metrics import MetricsError, ServerKV, ServerSample
from kvbench.errors import KvbenchError

DISCOVERY_TIMEOUT_S = 5.0
SERVE_HINT = "pip install 'kvbench[serve]' (aiohttp and prometheus-client)"
# Named warnings, each message's first word (the run goes on; the record says so).
NO_METRICS = "no-server-metrics"
UNKNOWN_METRICS = "unknown-server-metrics"
NO_CAPACITY = "no-kv-capacity"
SHAPE_MISMATCH = "kv-bytes-mismatch"

Get = Callable[[str], tuple[int, str]]  # GET url -> (status, body)
# Model names and versions shown in messages and the record are cut to this length.
SHOWN_CHARS = 100
SHOWN_MODELS = 10


class ServerSettings(Protocol):
    """What discovery reads of an ``openai`` section. The section
    (:mod:`kvbench.engines.external.openai.section`) calls discovery, so it is described here
    rather than imported."""

    @property
    def endpoint(self) -> str: ...
    @property
    def served_model(self) -> str | None: ...
    @property
    def api_key_env(self) -> str | None: ...
    @property
    def allow_redirects_to_other_hosts(self) -> bool: ...
    @property
    def origin(self) -> str: ...
    @property
    def metrics_endpoint(self) -> str: ...


@dataclass(slots=True)
class ServerInfo:
    model: str
    max_model_len: int | None
    version: str | None
    metrics_url: str | None  # None: the run has no server telemetry
    sample: ServerSample | None
    metrics_status: str
    warnings: list[str] = field(default_factory=list)
    redirects: dict[str, str] = field(default_factory=dict)  # followed: first URL -> last


def api_key(section: ServerSettings) -> str | None:
    """The API key from the environment variable the section names. The key itself is
    never stored, logged or written to a record."""
    if section.api_key_env is None:
        return None
    key = os.environ.get(section.api_key_env)
    if not key:
        raise KvbenchError(
            f"api_key_env names {section.api_key_env}, which is not set: export "
            f"{section.api_key_env}=<the server's API key>, or drop api_key_env"
        )
    return key


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def discover(section: ServerSettings, bytes_per_token: int) -> ServerInfo:
    """Ask the server at ``section.endpoint`` what it serves and publishes."""
    try:
        from kvbench.engines.external.openai.client import fetch_text, run_sync
        from kvbench.engines.external.openai.redirects import RedirectPolicy, RedirectRefused
    except ImportError as exc:
        raise KvbenchError(f"the openai engine needs {SERVE_HINT}: {exc}") from None
    key = api_key(section)
    endpoint = section.endpoint
    policy = RedirectPolicy(section.allow_redirects_to_other_hosts)

    def get(url: str) -> tuple[int, str]:
        return run_sync(lambda: fetch_text(url, bearer(key), DISCOVERY_TIMEOUT_S, policy))

    try:
        status, text = get(endpoint + "/models")
    except RedirectRefused as exc:
        raise KvbenchError(scrub(str(exc), key)) from None
    except BadReply as exc:
        raise KvbenchError(f"the server at {endpoint} answered GET /models with {exc}: is it "
                           "an OpenAI-compatible server?") from None
    except Exception as exc:
        raise KvbenchError(scrub(
            f"cannot reach the server at {endpoint} ({type(exc).__name__}: {exc}): start it, "
            "or set the engine's endpoint to where it listens (http://HOST:PORT/v1)", key)
        ) from None
    if status in (401, 403):
        where = (f"the key in {section.api_key_env} is not accepted" if section.api_key_env
                 else "set api_key_env to the environment variable holding its API key")
        raise KvbenchError(f"the server at {endpoint} refused the request (HTTP {status}): {where}")
    if status != 200:
        raise KvbenchError(
            f"the server at {endpoint} does not answer GET /models (HTTP {status}): is it an "
            "OpenAI-compatible server, and does the endpoint end in /v1?"
        )
    try:
        model, max_len = _pick_model(section, endpoint, text)
    except KvbenchError as exc:
        raise KvbenchError(scrub(str(exc), key)) from None
    version = _version(get, section.origin)
    info = ServerInfo(model, max_len, version and scrub(version, key), None, None, "")
    _read_metrics(info, section, get, bytes_per_token)
    info.warnings = [scrub(w, key) for w in info.warnings]
    info.metrics_status = scrub(info.metrics_status, key)
    info.redirects = {url: scrub(to, key) for url, to in policy.followed.items()}
    return info


def _pick_model(section: ServerSettings, endpoint: str, text: str) -> tuple[str, int | None]:
    try:
        models = {m["id"]: m for m in json.loads(text)["data"]}
        if not all(isinstance(name, str) and isinstance(m, dict) for name, m in models.items()):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise KvbenchError(
            f"the server at {endpoint} answered GET /models with no model list"
        ) from None
    name = section.served_model
    if name is None:
        if len(models) != 1:
            raise KvbenchError(
                f"the server at {endpoint} serves {len(models)} models ({_names(models)}): "
                "set served_model to the one to benchmark"
            )
        name = next(iter(models))
    elif name not in models:
        raise KvbenchError(
            f"the server at {endpoint} does not serve {name!r}; it serves "
            f"{_names(models) or 'nothing'}: set served_model to one of them"
        )
    max_len = models[name].get("max_model_len")
    # A context of 0 or beyond 2^31 tokens is no server's: unknown rather than wrong.
    return name, max_len if is_count(max_len, 1 << 31) and max_len > 0 else None


def _names(models: dict[str, object]) -> str:
    shown = [name[:SHOWN_CHARS] for name in list(models)[:SHOWN_MODELS]]
    more = len(models) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _version(get: Get, origin: str) -> str | None:
    try:
        status, text = get(origin + "/version")
        return str(json.loads(text)["version"])[:SHOWN_CHARS] if status == 200 else None
    except Exception:
        return None  # not every server says


def _unreadable(info: ServerInfo, url: str, reason: str) -> None:
    info.metrics_status = f"unreadable: {url}: {reason}"
    info.warnings.append(
        f"{NO_METRICS}: the server's metrics at {url} cannot be read ({reason}): the run goes "
        "on without server telemetry (no KV or queue curves)"
    )


def _read_metrics(
    info: ServerInfo, section: ServerSettings, get: Get, bytes_per_token: int
) -> None:
    from kvbench.engines.external.openai.server_metrics import parse_metrics

    url = section.metrics_endpoint
    try:
        status, text = get(url)
        reason = None if status == 200 else f"HTTP {status}"
    except BadReply as exc:  # a page too large to read
        return _unreadable(info, url, str(exc))
    except Exception as exc:
        text, reason = "", f"{type(exc).__name__}: {exc}"
    if reason is not None:
        info.metrics_status = f"unavailable: GET {url}: {reason}"
        info.warnings.append(
            f"{NO_METRICS}: the server publishes no Prometheus metrics at {url} ({reason}): "
            "the run goes on without server telemetry (no KV or queue curves); vLLM serves "
            "them by default, SGLang with --enable-metrics, or set metrics_url"
        )
        return
    try:
        sample = parse_metrics(text)
    except MetricsError as exc:
        return _unreadable(info, url, str(exc))
    if sample.dropped:
        info.warnings.append(
            f"{NO_METRICS}: {url} publishes non-finite or absurd values for "
            f"{', '.join(sample.dropped)}: they are treated as absent"
        )
    if sample.flavor == "unknown":
        info.metrics_status = f"unavailable: {url} has neither vLLM's nor SGLang's metrics"
        info.warnings.append(
            f"{UNKNOWN_METRICS}: {url} holds neither vLLM's nor SGLang's KV metrics: the run "
            "goes on without server telemetry"
        )
        return
    info.metrics_url, info.sample, info.metrics_status = url, sample, "ok"
    kv = ServerKV.of(sample, bytes_per_token)
    if kv.capacity_bytes is None:
        info.warnings.append(
            f"{NO_CAPACITY}: the {sample.flavor} server publishes no usable KV pool size: "
            "KV capacity and free memory are unknown (null) in the record"
        )
    blocks, size, budget = sample.capacity_blocks, sample.block_size, sample.kv_cache_memory_bytes
    if blocks and size and budget and budget // (size * bytes_per_token) != blocks:
        served = budget // (blocks * size)
        info.warnings.append(
            f"{SHAPE_MISMATCH}: the server holds {blocks} blocks of {size} tokens in {budget} "
            f"bytes, about {served} bytes per token, but the run's model preset takes "
            f"{bytes_per_token}: KV bytes in the record follow the preset; name the served "
            "model's shapes and dtype with --model and the suite's model dtype"
        )
