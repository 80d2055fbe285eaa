"""A small OpenAI-compatible server for the openai engine's error paths (the real one is
vLLM, in tests/vllm). Run as ``python fake_openai_server.py CONFIG_JSON``: it listens on
127.0.0.1 at a free port, prints the port, and serves until killed.

It streams ``max_tokens`` tokens per completion (one chunk each, with token ids unless
``no_token_ids``), publishes vLLM- or SGLang-style metrics computed from its in-flight
requests (or none, or unrelated ones), and misbehaves on request: HTTP errors, hangs or
wrong usage counts for requests of a given ``max_tokens``, an API key, or dying (the whole
process, at once) after a number of streamed tokens. ``GET /_log`` returns the bodies and
authorization headers it received.

Hostile replies, for the engine's defences: ``echo_auth`` (error messages quote the
Authorization header), ``raw_on`` (for a ``max_tokens``: a status and body frames sent
verbatim, ``{auth}`` and ``{key}`` standing for the header and its key, a frame
``[text, times]`` repeated), ``factor_on`` (that many times the tokens asked for),
``crlf`` (events separated by CRLF), ``redirect`` (307 to ``host`` or the same host, on
``paths``), ``metrics_page`` (served verbatim), ``metrics_series`` (a page of that many
series), ``nan_while_busy`` (NaN and +Inf gauges while requests are in flight) and
``offload`` (an offloading connector's and LMCache's families on the vLLM page).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from typing import Any

from aiohttp import web

BLOCK = 32
NUM_BLOCKS = 64


class Fake:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.model = cfg.get("model", "fake-model")
        self.inflight: dict[int, list[int]] = {}  # request -> [prompt, generated]
        self.next_id = 0
        self.streamed = 0
        self.prefix_queries = 0
        self.log: list[dict[str, Any]] = []

    async def models(self, request: web.Request) -> web.Response:
        if (denied := self._auth(request)) is not None:
            return denied
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model",
                                         "max_model_len": self.cfg.get("max_model_len", 512)}]}
        )

    async def models_or_redirect(self, request: web.Request) -> web.Response:
        return self._redirect(request) or await self.models(request)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fake-1"})

    async def metrics(self, request: web.Request) -> web.Response:
        if (redirected := self._redirect(request)) is not None:
            return redirected
        kind = self.cfg.get("metrics", "vllm")
        if kind == "none":
            raise web.HTTPNotFound()
        if "metrics_page" in self.cfg:
            return web.Response(text=self.cfg["metrics_page"], content_type="text/plain")
        if "metrics_series" in self.cfg:
            lines = (f'vllm:num_requests_running{{i="{i}"}} 1\n'
                     for i in range(self.cfg["metrics_series"]))
            return web.Response(text="".join(lines), content_type="text/plain")
        running: float = len(self.inflight)
        blocks = sum(math.ceil(sum(v) / BLOCK) for v in self.inflight.values())
        tokens = sum(sum(v) for v in self.inflight.values())
        usage = blocks / (NUM_BLOCKS - 1)
        if self.cfg.get("nan_while_busy") and self.inflight:
            usage, running = math.nan, math.inf
        if kind == "vllm":
            lab = f'{{engine="0",model_name="{self.model}"}}'
            text = (
                "# HELP vllm:num_requests_running running\n# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{lab} {float(running)}\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{lab} 0.0\n"
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f"vllm:kv_cache_usage_perc{lab} {usage}\n"
                "# TYPE vllm:prefix_cache_queries counter\n"
                f"vllm:prefix_cache_queries_total{lab} {self.prefix_queries}.0\n"
                "# TYPE vllm:prefix_cache_hits counter\n"
                f"vllm:prefix_cache_hits_total{lab} 0.0\n"
                "# TYPE vllm:num_preemptions counter\n"
                f"vllm:num_preemptions_total{lab} 0.0\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0",'
                f'num_gpu_blocks="{NUM_BLOCKS}",num_gpu_blocks_override="None"}} 1.0\n'
            )
            if self.cfg.get("offload"):
                text += self._offload_families(lab)
        elif kind == "sglang":
            lab = f'{{model_name="{self.model}"}}'
            cap = NUM_BLOCKS * BLOCK
            text = (
                f"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{lab} {running}\n"
                f"# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{lab} 0\n"
                f"# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens{lab} {tokens}\n"
                f"# TYPE sglang:token_usage gauge\nsglang:token_usage{lab} {tokens / cap}\n"
                f"# TYPE sglang:max_total_num_tokens gauge\n"
                f"sglang:max_total_num_tokens{lab} {cap}\n"
                f"# TYPE sglang:cache_hit_rate gauge\nsglang:cache_hit_rate{lab} 0.25\n"
            )
        else:  # metrics of something else entirely
            text = "# TYPE http_requests_total counter\nhttp_requests_total 3.0\n"
        return web.Response(text=text, content_type="text/plain")

    def _offload_families(self, lab: str) -> str:
        """An offloading connector's counters and LMCache's CPU bytes, as vLLM publishes
        them: half the prompt tokens served from CPU memory, 1 KiB loaded per token queried
        at 1 GB/s, and 4 KiB held per request received."""
        q = self.prefix_queries
        return (
            "# TYPE vllm:external_prefix_cache_hits counter\n"
            f"vllm:external_prefix_cache_hits_total{lab} {q // 2}.0\n"
            "# TYPE vllm:kv_offload_load_bytes counter\n"
            f"vllm:kv_offload_load_bytes_total{lab} {q * 1024}.0\n"
            "# TYPE vllm:kv_offload_load_time counter\n"
            f"vllm:kv_offload_load_time_total{lab} {q * 1024 / 1e9}\n"
            "# TYPE lmcache:local_cache_usage gauge\n"
            f'lmcache:local_cache_usage{{model_name="{self.model}",worker_id="0"}} '
            f"{4096 * self.next_id}\n"
        )

    async def get_log(self, request: web.Request) -> web.Response:
        return web.json_response(self.log)

    def _auth(self, request: web.Request) -> web.Response | None:
        key = self.cfg.get("api_key")
        if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return None

    def _redirect(self, request: web.Request) -> web.Response | None:
        """A 307 to the same path on ``redirect.host`` (or this host), once: the target
        carries ``hop=1``."""
        spec = self.cfg.get("redirect")
        if spec is None or request.path not in spec["paths"] or "hop" in request.query:
            return None
        host = spec.get("host") or request.url.host
        location = f"http://{host}:{request.url.port}{request.path}?hop=1"
        return web.Response(status=307, headers={"Location": location})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if (redirected := self._redirect(request)) is not None:
            return redirected
        auth = request.headers.get("Authorization")
        entry = {"path": request.path, "host": request.url.host, "authorization": auth}
        self.log.append(entry)
        if (denied := self._auth(request)) is not None:
            return denied
        body = await request.json()
        entry["body"] = body
        out = int(body["max_tokens"])
        status = self.cfg.get("status_on", {}).get(str(out))
        if status is not None:
            echo = f" for {auth}" if self.cfg.get("echo_auth") else ""
            return web.json_response({"error": {"message": f"scripted {status}{echo}"}},
                                     status=status)
        if str(out) in self.cfg.get("raw_on", {}):
            return await self._raw(request, self.cfg["raw_on"][str(out)], auth or "")
        if str(out) in self.cfg.get("hang_on", []):
            await asyncio.sleep(60)
        prompt_len = _prompt_len(body)
        n = int(body.get("n", 1))
        self.prefix_queries += prompt_len
        rid = self.next_id
        self.next_id += 1
        self.inflight[rid] = [prompt_len, 0]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body
        end = "\r\n\r\n" if self.cfg.get("crlf") else "\n\n"
        streamed = out * self.cfg.get("factor_on", {}).get(str(out), 1)
        try:
            await asyncio.sleep(self.cfg.get("first_token_delay_s", 0.005))
            for i in range(streamed):
                for index in range(n):
                    choice: dict[str, Any] = {"index": index, "finish_reason": (
                        "length" if i == streamed - 1 else None)}
                    if chat:
                        choice["delta"] = {"content": f" w{i}"}
                    else:
                        choice["text"] = f" w{i}"
                    if not self.cfg.get("no_token_ids"):
                        choice["token_ids"] = [(7 * i + index) % 4096]
                    await resp.write(f"data: {json.dumps({'choices': [choice]})}{end}".encode())
                self.inflight[rid][1] += 1
                self.streamed += 1
                if self.streamed == self.cfg.get("die_after_tokens"):
                    os._exit(1)  # the server dies at once, connections and all
                await asyncio.sleep(self.cfg.get("token_delay_s", 0.002))
            completion = streamed * n + int(self.cfg.get("usage_off_by", 0))
            usage = {"prompt_tokens": prompt_len, "completion_tokens": completion,
                     "total_tokens": prompt_len + completion}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}{end}".encode())
            await resp.write(f"data: [DONE]{end}".encode())
        finally:
            del self.inflight[rid]
        return resp

    async def _raw(self, request: web.Request, spec: dict[str, Any],
                   auth: str) -> web.StreamResponse:
        """A scripted reply: ``status`` (200) and ``frames`` written as they are."""
        resp = web.StreamResponse(status=spec.get("status", 200),
                                  headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        key = auth.removeprefix("Bearer ")
        for frame in spec["frames"]:
            text, times = (frame, 1) if isinstance(frame, str) else frame
            data = text.replace("{auth}", auth).replace("{key}", key).encode("utf-8",
                                                                             "surrogateescape")
            for _ in range(times):
                await resp.write(data)
        return resp


def _prompt_len(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt.split())
    # chat: count text words and one token per image
    parts = body["messages"][0]["content"]
    return sum(len(p["text"].split()) if p["type"] == "text" else 1 for p in parts)


def main() -> None:
    fake = Fake(json.loads(sys.argv[1]))
    app = web.Application()
    app.router.add_get("/v1/models", fake.models_or_redirect)
    app.router.add_get("/version", fake.version)
    app.router.add_get("/metrics", fake.metrics)
    app.router.add_get("/_log", fake.get_log)
    app.router.add_post("/v1/completions", fake.completions)
    app.router.add_post("/v1/chat/completions", fake.completions)

    async def serve() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
