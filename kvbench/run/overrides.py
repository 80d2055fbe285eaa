"""Command-line overrides of a suite's fields: the run flags every run-shaped command takes
(``run``, ``soak``, ``sweep``), declared once here with their help, and applied to a suite.

Each :class:`RunFlags` field names the suite field it overrides (``target``); the CLI builds
its options from these fields, so a new flag is one field here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from pydantic import ValidationError

    from kvbench.run.suite import Suite

# The CLI builds its options from RunFlags when it starts: the engines, suites and trace
# readers this module applies flags with are imported where they are used, so that
# `kvbench --help` loads none of them.


def _flag(target: str, help: str, decls: tuple[str, ...] = ()) -> Any:
    return field(default=None, metadata={"target": target, "help": help, "decls": decls})


@dataclass(slots=True)
class RunFlags:
    """The run flags; None leaves the suite's value."""

    engines: str | None = _flag("run.engines", "Comma-separated engines, e.g. paged,contiguous.")
    workload: str | None = _flag(
        "workload", "Workload preset, FILE.jsonl or KIND:TRACE_PATH "
        "(azure|azure-lmm|mooncake|sharegpt)."
    )
    image_rule: str | None = _flag(
        "workload.image_rule", "azure-lmm traces: every image's token rule and size, "
        "RULE[:HxW], e.g. qwen2-vl:448x448 (default llava-1.5)."
    )
    num_requests: int | None = _flag(
        "workload.num_requests", "Number of requests (first N of a file or trace)."
    )
    seed: int | None = _flag("workload.seed", "Workload seed (a non-negative integer).")
    model: str | None = _flag("model.preset", "Model preset.")
    device: str | None = _flag(
        "run.device", "auto | cpu | cuda[:N] | sim:GPU[xTP] (e.g. sim:a100-80gbx8) | "
        "sim:PROFILE.json."
    )
    clock: str | None = _flag(
        "run.clock", "wall | virtual (default: virtual for sim, else wall)."
    )
    kv_memory: str | None = _flag(
        "run.kv_memory", "KV budget, e.g. 64MiB (default: from device memory)."
    )
    block_size: int | None = _flag("run.block_size", "Paged KV block size in tokens.")
    max_num_seqs: int | None = _flag("run.max_num_seqs", "Most sequences running at once.")
    max_num_batched_tokens: int | None = _flag(
        "run.max_num_batched_tokens", "Token budget per step."
    )
    max_model_len: int | None = _flag("run.max_model_len", "Context limit per sequence.")
    chunked_prefill: bool | None = _flag(
        "run.chunked_prefill", "Split long prompts over steps.",
        ("--chunked-prefill/--no-chunked-prefill",),
    )
    prefix_caching: bool | None = _flag(
        "run.prefix_caching", "Reuse cached KV of shared prompt prefixes.",
        ("--prefix-caching/--no-prefix-caching",),
    )
    kv_offload: str | None = _flag(
        "run.kv_offload", "Paged engines: keep evicted prefix-cache blocks in tiers below "
        "device memory, KIND:SIZE[:lru|lfu|cost][@LINK],... e.g. cpu:64GiB,disk:1TiB "
        "(kinds cpu|cxl|disk; links pcie4|pcie5|cxl|nvme-gen4|nvme-gen5|NGBps; real compute "
        "takes one cpu tier)."
    )
    kv_preemption: str | None = _flag(
        "run.kv_preemption", "Paged engines: what a preempted sequence's KV becomes, "
        "recompute (freed, computed again) or swap (copied to the first offload tier and "
        "back)."
    )
    slo: str | None = _flag(
        "run.slo", "Goodput SLO in ms, e.g. ttft:500,tpot:50[,e2el:MS]."
    )
    cpu_threads: int | None = _flag(
        "run.cpu_threads", "torch's CPU threads for every engine of a CPU run, in-process vLLM's "
        "included (default: torch's)."
    )
    attention: str | None = _flag(
        "run.attention", "Attention kernels of real compute: auto (triton on CUDA when "
        "installed; on the CPU native, a C decode kernel built with the machine's compiler, "
        "where one is found; else reference) | native | triton | reference."
    )
    request_rate: float | None = _flag(
        "run.request_rate", "Re-time arrivals at R requests/s (inf: all at once, an offline, "
        "engine-bound load), as vllm bench serve --request-rate. Without it a --workload trace "
        "with timestamps (azure, azure-lmm, mooncake) replays them."
    )
    burstiness: float | None = _flag(
        "run.burstiness", "With --request-rate: gamma-distributed gaps of this shape "
        "(1: Poisson; below 1 burstier), as vllm bench serve --burstiness."
    )
    max_concurrency: int | None = _flag(
        "run.max_concurrency", "Most requests in flight at once: later arrivals wait "
        "client-side until one finishes (as vllm bench serve --max-concurrency)."
    )
    replicas: int | None = _flag(
        "cluster.replicas", "Simulated device: run N replicas of each engine behind a router "
        "on one virtual clock (records hold cluster totals and per-replica curves)."
    )
    router: str | None = _flag(
        "cluster.router", "With replicas: round-robin | least-outstanding | least-kv | "
        "prefix-aware | session-affinity."
    )
    load_cap: float | None = _flag(
        "cluster.load_cap", "prefix-aware router: a replica above this many times the mean "
        "outstanding requests takes no more (default 1.5)."
    )
    prefill_replicas: int | None = _flag(
        "cluster.prefill_replicas", "Disaggregated: prefill replicas (with --decode-replicas); "
        "KV goes to decode replicas over --link."
    )
    decode_replicas: int | None = _flag(
        "cluster.decode_replicas", "Disaggregated: decode replicas (with --prefill-replicas)."
    )
    link: str | None = _flag(
        "cluster.link", "Disaggregated: the KV-transfer link: nvlink-a100 | nvlink-h100 | "
        "ib-hdr | ib-ndr | roce-100g | roce-200g | roce-400g."
    )
    attention_impl: str | None = _flag(
        "run.attention_impl", "Simulated device: the attention kernel whose workspace "
        "device memory counts: fused | cpu-reference | sdpa-dense-mask | eager."
    )
    kv_allocation: str | None = _flag(
        "run.kv_allocation", "Simulated device: preallocated (vLLM's pool) | on-demand "
        "(a dynamic cache growing through the caching allocator)."
    )
    fast_forward: bool | None = _flag(
        "run.fast_forward", "Simulated engines (virtual clock): take the decode-only steps "
        "between events in one go; --no-fast-forward steps one at a time (same records).",
        ("--fast-forward/--no-fast-forward",),
    )
    quality_check: bool | None = _flag(
        "run.quality_check", "Real compute: compare the greedy outputs and first-token logits "
        "of every engine storing KV below the model's dtype with a full-precision pass of the "
        "same policy (costs one more run); --no-quality-check skips it.",
        ("--quality-check/--no-quality-check",),
    )
    in_process: bool | None = _flag(
        "run.in_process", "Wall clock: run every engine in this process (for debugging) "
        "instead of each in a fresh one, so that later engines inherit earlier ones' memory, "
        "thread pools and caches.",
        ("--in-process/--isolated",),
    )
    extra_kv_window_tokens: int | None = _flag(
        "run.extra_kv_window_tokens", "Simulated device: extra keys/values per layer kept "
        "for each running sequence (an undisabled sliding window)."
    )
    base_url: str | None = _flag(
        "serve.base_url", "Drive a live OpenAI-compatible server at this URL, e.g. "
        "http://127.0.0.1:8000, with no suite file, as vllm bench serve --base-url: an openai "
        "engine (named after --served-model when that is a safe file name, else openai), the "
        "run's only engine unless --engines names others; wall clock, a real device."
    )
    endpoint: str | None = _flag(
        "serve.endpoint", "With --base-url: the API path, /v1/completions (default) or "
        "/v1/chat/completions (every request as a chat message)."
    )
    served_model: str | None = _flag(
        "serve.served_model", "With --base-url: the model to ask for (default: the one the "
        "server serves)."
    )
    api_key_env: str | None = _flag(
        "serve.api_key_env", "With --base-url: the environment variable holding the server's "
        "API key (the key is never written)."
    )


def flag_name(name: str) -> str:
    """The command-line spelling of a :class:`RunFlags` field."""
    return "--" + name.replace("_", "-")


# Targets of the flags that build a served engine rather than set one suite field.
SERVE = "serve."
_BY_TARGET = {f.metadata["target"]: f.name for f in fields(RunFlags)}

# Trace kinds whose rows carry arrival timestamps (ShareGPT's have none: all arrive at 0 s).
TIMED_TRACE_KINDS = ("azure", "azure-lmm", "mooncake")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def resolve_suite(ref: str | None, flags: RunFlags) -> tuple[Suite, Path | None]:
    """Load ``ref`` and apply ``flags``, re-validated as if written in the suite file; a bad
    value is reported against the flag that gave it."""
    from pydantic import ValidationError

    from kvbench.results.slo import parse_slo
    from kvbench.run.suite import load_suite

    _check_serve_flags(flags)
    suite, base = load_suite(ref)
    r, m = suite.run, suite.model
    # Suite values chosen for the suite's own workload, model or device are dropped when
    # that is overridden, unless given again.
    if flags.workload is not None:
        _replace_workload(suite, flags.workload)
        base = None
    if flags.model is not None:
        r.max_model_len, r.kv_memory, m.dtype = None, None, None
    if flags.device is not None:
        r.clock, r.kv_memory = "auto", None
        # How the suite's simulated device's memory is modelled belongs to that device.
        r.attention_impl, r.kv_allocation, r.extra_kv_window_tokens = "fused", "preallocated", 0
    data = suite.model_dump()
    for f in fields(RunFlags):
        value = getattr(flags, f.name)
        target = f.metadata["target"]
        if value is None or target == "workload" or target.startswith(SERVE):
            continue
        if f.name == "engines":
            value = _csv(value)
        elif f.name == "slo":
            value = parse_slo(value).model_dump()
        section, key = target.split(".")
        data[section][key] = value
    if flags.base_url is not None:
        _add_served_engine(data, flags)
    try:
        return type(suite).model_validate(data), base
    except ValidationError as exc:
        raise KvbenchError(_flag_errors(exc, suite.name)) from None


def _check_serve_flags(flags: RunFlags) -> None:
    """Refuse server flags that cannot go together, before any suite is read."""
    needs_url = [flag_name(n) for n in ("endpoint", "served_model", "api_key_env")
                 if getattr(flags, n) is not None]
    if flags.base_url is None:
        if needs_url:
            raise KvbenchError(f"{', '.join(needs_url)} needs --base-url: give the server's "
                               "URL, e.g. --base-url http://127.0.0.1:8000")
        return
    if flags.device is not None and flags.device.startswith("sim:"):
        raise KvbenchError("--base-url drives a live server in real time: drop --device "
                           f"{flags.device} (a simulated device), or drop --base-url")
    if flags.clock == "virtual":
        raise KvbenchError("--base-url drives a live server in real time: drop --clock "
                           "virtual, or drop --base-url")
    if flags.api_key_env is not None and not _ENV_NAME.fullmatch(flags.api_key_env):
        # Not echoed: a key given where its variable's name belongs must not be printed.
        raise KvbenchError("--api-key-env takes the name of an environment variable (letters, "
                           "digits and _), e.g. OPENAI_API_KEY, not the key itself")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The API paths --endpoint takes, as vllm bench serve's, and whether each sends chat
# (the longer first: a chat path ends in /completions too).
_API_PATHS = {"/chat/completions": True, "/completions": False}


def _served_endpoint(base_url: str, path: str) -> tuple[str, bool]:
    """The openai section's endpoint (the API root) for ``--base-url`` and ``--endpoint``,
    and whether requests go as chat. A base URL that already ends in the API root (``/v1``)
    is not given it twice."""
    suffix = next((s for s in _API_PATHS if path.endswith(s)), None)
    if not path.startswith("/") or suffix is None:
        raise KvbenchError(f"--endpoint {path!r}: give an API path ending in /completions or "
                           "/chat/completions, e.g. /v1/completions")
    parts = urlsplit(base_url)
    if parts.username is not None or parts.password is not None:
        # A secret in the URL would be written into every record.
        raise KvbenchError("--base-url must not hold credentials: put the key in an "
                           "environment variable and name it with --api-key-env")
    if parts.query or parts.fragment:
        # Not echoed: a query may carry a token.
        raise KvbenchError("--base-url: give the server's URL without a query or fragment, "
                           "e.g. http://127.0.0.1:8000")
    root, base = path.removesuffix(suffix), base_url.rstrip("/")
    if root and base.endswith(root):
        root = ""
    return base + root, _API_PATHS[suffix]


def _add_served_engine(data: dict[str, Any], flags: RunFlags) -> None:
    """Add the engine ``--base-url`` describes to the suite's ``data`` and select it: alone,
    or beside the engines ``--engines`` names (its ``openai`` being this one)."""
    from pydantic import ValidationError

    from kvbench.engines.external.openai.section import OpenAISection
    from kvbench.engines.registry import NAMED_ENGINES
    from kvbench.results.paths import path_component_problem

    assert flags.base_url is not None
    endpoint, chat = _served_endpoint(flags.base_url, flags.endpoint or "/v1/completions")
    try:
        section = OpenAISection(endpoint=endpoint, served_model=flags.served_model,
                                api_key_env=flags.api_key_env, chat=chat)
    except ValidationError as exc:
        msg = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise KvbenchError(f"--base-url: {msg}") from None
    model, taken = flags.served_model, {*NAMED_ENGINES, *data["engines"]}
    safe = model is not None and path_component_problem(model, "engine") is None
    name = model if safe and model not in taken else "openai"
    data["engines"][name] = section.model_dump()
    chosen = _csv(flags.engines) if flags.engines is not None else []
    chosen = [name if n == "openai" else n for n in chosen]
    data["run"]["engines"] = list(dict.fromkeys([*chosen, name]))
    if str(data["run"]["device"]).startswith("sim:"):
        raise KvbenchError(f"--base-url drives a live server in real time, and the suite's "
                           f"device is simulated ({data['run']['device']}): add --device cpu")
    data["run"]["clock"] = "wall"


def _replace_workload(suite: Suite, ref: str) -> None:
    """Point ``suite`` at the workload ``--workload`` names. A trace with timestamps replays
    them: the suite's re-timing (e.g. the default suite's ``request_rate = inf``) was chosen
    for its own workload, so it is dropped; ``--request-rate`` still re-times."""
    from kvbench.results.paths import path_length_problem
    from kvbench.workloads.traces import TRACE_KINDS

    if (problem := path_length_problem(ref, "--workload")) is not None:
        raise KvbenchError(problem)
    w, r = suite.workload, suite.run
    w.num_requests = None
    w.preset = w.file = w.trace = w.path = w.spec = None
    kind, _, rest = ref.partition(":")
    if kind in TRACE_KINDS and rest:
        w.trace, w.path = kind, rest  # type: ignore[assignment]
        if kind in TIMED_TRACE_KINDS:
            r.request_rate, r.burstiness = None, 1.0
    elif ref.endswith(".jsonl") or Path(ref).exists():
        w.file = ref
    else:
        w.preset = ref


def _flag_errors(exc: ValidationError, suite: str) -> str:
    """One clause per bad value, naming the flag that set it (or the suite field)."""
    parts = []
    for e in exc.errors():
        loc = [str(x) for x in e["loc"]]
        target = ".".join(loc[:2])
        name = _BY_TARGET.get(target)
        where = flag_name(name) if name else f"suite {suite}: {'.'.join(loc)}"
        value = e.get("input")
        shown = f" {value!r}" if name and not isinstance(value, dict | list) else ""
        parts.append(f"{where}{shown}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)
