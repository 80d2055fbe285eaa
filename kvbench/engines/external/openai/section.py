"""The ``openai`` engine kind's suite section: where the server is and how to talk to it."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from kvbench.engines.config import EngineConfig, EngineSection, ServerProcess
from kvbench.engines.external.openai.discovery import ServerInfo, discover
from kvbench.workloads.model import Request


class OpenAISection(EngineSection):
    """A live OpenAI-compatible server (vLLM, SGLang, ...) at ``endpoint``.

    The run's model preset must describe the served model: its vocabulary bounds the token
    ids sent, its shapes give the bytes per token that turn the server's KV usage into
    bytes. ``api_key_env`` names the environment variable holding the API key (the key is
    never written anywhere). ``server_pid`` and ``gpu_index`` (NVML's numbering) let
    telemetry read the server's RSS and GPU memory when it runs on this machine.
    """

    kind: Literal["openai"] = "openai"
    summary = "a live OpenAI-compatible server: streamed latencies, KV and queues from /metrics"
    realtime = True

    endpoint: str = "http://127.0.0.1:8000/v1"
    served_model: str | None = None
    api_key_env: str | None = None
    metrics_url: str | None = None  # default: /metrics at the endpoint's host
    scrape_interval_ms: float = Field(default=100.0, ge=10.0)
    # The server renders /metrics on its API process, between streamed chunks (a vLLM CPU
    # server takes tens of ms a page): readings are spaced so that they take at most this
    # share of its time, keeping the observer's cost on the latencies measured small.
    scrape_max_duty: float = Field(default=0.05, gt=0.0, le=1.0)
    server_pid: int | None = Field(default=None, ge=1)
    gpu_index: int | None = Field(default=None, ge=0)
    # auto: token ids where the server is known to take them (vLLM, SGLang), else text.
    prompt_format: Literal["auto", "token_ids", "text"] = "auto"
    # images: image segments as synthetic PNGs through chat completions (a multimodal
    # model); placeholder: as placeholder ids or words of the same count.
    multimodal: Literal["placeholder", "images"] = "placeholder"
    # Every request through chat completions (text as words), as vllm bench serve's
    # --endpoint /v1/chat/completions; else chat only for images.
    chat: bool = False
    request_timeout_s: float = Field(default=600.0, gt=0)
    # The whole run's deadline: requests unfinished then fail, and the run ends (failed)
    # with what completed. None: no deadline beyond each request's timeout.
    run_timeout_s: float | None = Field(default=None, gt=0)
    max_connections: int = Field(default=256, ge=1)
    # A redirect to another host (name or port) would send the workload (and, without
    # this check, the key) to a server nobody named: refused unless allowed here.
    allow_redirects_to_other_hosts: bool = False

    @field_validator("endpoint", "metrics_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{value!r} is not an http(s) URL such as http://127.0.0.1:8000/v1")
        return value.rstrip("/")

    @property
    def origin(self) -> str:
        parts = urlsplit(self.endpoint)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def metrics_endpoint(self) -> str:
        return self.metrics_url or self.origin + "/metrics"

    def label(self) -> str:
        return f"openai {urlsplit(self.endpoint).netloc}"

    def discover(self, config: EngineConfig) -> ServerInfo:
        return discover(self, config.preset.kv_bytes_per_token)

    def check(self, config: EngineConfig) -> list[str]:
        return self.discover(config).warnings

    def admission(self, config: EngineConfig) -> Callable[[Request], str | None]:
        return partial(served_rejection, self.discover(config).max_model_len)

    def server(self) -> ServerProcess:
        return ServerProcess(self.server_pid, self.gpu_index)


def served_rejection(max_model_len: int | None, request: Request) -> str | None:
    """A request longer than the server's context would only come back as HTTP 400."""
    need = request.prompt_tokens + request.output_tokens
    if max_model_len is not None and need > max_model_len:
        return (
            f"needs {need} tokens (prompt {request.prompt_tokens} + output "
            f"{request.output_tokens}), more than the server's max_model_len {max_model_len}"
        )
    return None
