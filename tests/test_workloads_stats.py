"""Workload summaries and the shareable-prefix fraction."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.workloads.model import Request, Segment, Workload
from kvbench.workloads.presets import generate_preset
from kvbench.workloads.stats import describe, shareable_prefix_fraction
from kvbench.workloads.traces import import_trace

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB = 1 << 30  # large, so distinct keys never collide by chance over a few tokens


def _workload(prompts: list[list[tuple[str, int]]]) -> Workload:
    reqs = [
        Request(f"r{i}", float(i), tuple(Segment("text", n, k) for k, n in segs), 1)
        for i, segs in enumerate(prompts)
    ]
    return Workload("t", reqs, seed=0)


def _brute_force(w: Workload, block: int) -> float:
    seen: list[np.ndarray] = []
    shareable = total = 0
    for r in w.requests:
        ids = r.prompt_token_ids(VOCAB)
        best = 0
        for prev in seen:
            m = min(len(ids), len(prev))
            diff = np.flatnonzero(ids[:m] != prev[:m])
            best = max(best, int(diff[0]) if len(diff) else m)
        shareable += best // block * block
        total += len(ids)
        seen.append(ids)
    return shareable / total


run = st.tuples(st.sampled_from("abcd"), st.integers(1, 40))


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(run, min_size=1, max_size=5), min_size=1, max_size=8))
def test_prefix_fraction_matches_token_comparison(prompts: list[list[tuple[str, int]]]) -> None:
    w = _workload(prompts)
    assert shareable_prefix_fraction(w, 4) == _brute_force(w, 4)


def test_prefix_fraction_examples() -> None:
    # Second request repeats the first 40 tokens of "sys" then diverges: 2 full 16-blocks.
    w = _workload([[("sys", 40), ("u1", 10)], [("sys", 40), ("u2", 30)], [("x", 8)]])
    assert shareable_prefix_fraction(w) == 32 / (50 + 70 + 8)
    # A shorter run of the same key still shares its tokens.
    w = _workload([[("doc", 100)], [("doc", 64), ("q", 5)]])
    assert shareable_prefix_fraction(w) == 64 / 169


def test_describe_counts_and_mix() -> None:
    w = generate_preset("mixed-multimodal", num_requests=200, seed=1)
    d = describe(w)
    assert d["num_requests"] == 200 and d["digest"] == w.digest
    assert d["prompt_tokens_total"] == sum(r.prompt_tokens for r in w.requests)
    assert set(d["prompt_tokens"]) == {"mean", "p50", "p90", "p99", "max"}
    assert d["prompt_tokens"]["max"] == max(r.prompt_tokens for r in w.requests)
    mix = d["modalities"]
    assert sum(m["tokens"] for m in mix.values()) == d["prompt_tokens_total"]
    assert mix["image"]["requests"] > 0 and mix["audio"]["requests"] > 0
    assert d["mean_arrival_rate_per_s"] == (200 - 1) / d["duration_s"]
    assert d["shareable_prefix_fraction"] == 0.0


def test_describe_sharing_presets() -> None:
    prefix = describe(generate_preset("shared-prefix"))
    assert prefix["num_prefix_groups"] == 6 and prefix["shareable_prefix_fraction"] > 0.5
    turns = describe(generate_preset("multi-turn"))
    assert turns["num_sessions"] > 10 and turns["shareable_prefix_fraction"] > 0.3
    par = describe(generate_preset("parallel-sampling"))
    assert par["num_sequences"] > par["num_requests"]


def test_offline_workload_has_no_rate() -> None:
    w = _workload([[("a", 5)], [("b", 5)]])
    w.requests = [Request(r.id, 0.0, r.segments, 1) for r in w.requests]
    d = describe(w)
    assert d["duration_s"] == 0.0 and d["mean_arrival_rate_per_s"] is None


def test_mooncake_fixture_shares_prefixes() -> None:
    w = import_trace("mooncake", FIXTURES / "mooncake_synthetic_trace_head300.jsonl")
    assert 0.0 < describe(w)["shareable_prefix_fraction"] < 1.0


def test_describe_full_mooncake_in_seconds(traces_dir: Path) -> None:
    w = import_trace("mooncake", traces_dir / "mooncake_synthetic_trace.jsonl")
    start = time.perf_counter()
    d = describe(w)
    assert time.perf_counter() - start < 3.0
    assert d["num_requests"] == 3993 and d["shareable_prefix_fraction"] > 0.3
