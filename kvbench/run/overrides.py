"""Command-line overrides of a suite's fields, shared by the commands that run suites."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.results.slo import parse_slo
from kvbench.run.suite import Suite, load_suite

TRACE_KINDS = ("azure", "mooncake", "sharegpt")


@dataclass(slots=True)
class RunFlags:
    """The ``kvbench run`` flags; None leaves the suite's value."""

    engines: str | None = None
    workload: str | None = None
    num_requests: int | None = None
    seed: int | None = None
    model: str | None = None
    device: str | None = None
    clock: str | None = None
    kv_memory: str | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None
    slo: str | None = None
    cpu_threads: int | None = None
    attention: str | None = None


def _csv(text: str | None) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def resolve_suite(ref: str | None, flags: RunFlags) -> tuple[Suite, Path | None]:
    """Load ``ref`` and apply ``flags``, re-validated as if written in the suite file."""
    suite, base = load_suite(ref)
    r, w, m = suite.run, suite.workload, suite.model
    # Suite values chosen for the suite's own workload, model or device are dropped when
    # that is overridden, unless given again.
    if flags.workload is not None:
        w.num_requests = None
        w.preset = w.file = w.trace = w.path = None
        kind, _, rest = flags.workload.partition(":")
        if kind in TRACE_KINDS and rest:
            w.trace, w.path = kind, rest  # type: ignore[assignment]
        elif flags.workload.endswith(".jsonl") or Path(flags.workload).exists():
            w.file = flags.workload
        else:
            w.preset = flags.workload
        base = None
    if flags.model is not None:
        r.max_model_len, r.kv_memory, m.dtype = None, None, None
    if flags.device is not None:
        r.clock, r.kv_memory = "auto", None
    if flags.clock is not None and flags.clock not in ("wall", "virtual", "auto"):
        raise KvbenchError(f"unknown clock {flags.clock!r}; use wall or virtual")
    for obj, key, value in (
        (w, "num_requests", flags.num_requests), (w, "seed", flags.seed),
        (m, "preset", flags.model), (r, "device", flags.device), (r, "clock", flags.clock),
        (r, "kv_memory", flags.kv_memory), (r, "block_size", flags.block_size),
        (r, "max_num_seqs", flags.max_num_seqs),
        (r, "max_num_batched_tokens", flags.max_num_batched_tokens),
        (r, "max_model_len", flags.max_model_len), (r, "chunked_prefill", flags.chunked_prefill),
        (r, "prefix_caching", flags.prefix_caching), (r, "engines", _csv(flags.engines)),
        (r, "slo", parse_slo(flags.slo) if flags.slo is not None else None),
        (r, "cpu_threads", flags.cpu_threads), (r, "attention", flags.attention),
    ):
        if value is not None:
            setattr(obj, key, value)
    return type(suite).model_validate(suite.model_dump()), base
