"""Generating at scale: same requests and digests as before, built lean, refused when too big."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import tracemalloc

import pytest

from helpers import REPO
from kvbench.errors import KvbenchError
from kvbench.workloads import limits
from kvbench.workloads.bulk import collector_paused, new_request, new_segment, text_segment
from kvbench.workloads.generator import generate
from kvbench.workloads.model import Request, Segment, Workload
from kvbench.workloads.presets import generate_preset, get_preset_spec, preset_names
from kvbench.workloads.traces import import_trace

# Digests of preset workloads as this generator has always made them. The quick-sim baseline
# (results/baselines/any/quick-sim) records mixed-text at 200 requests, seed 0.
PINNED = {
    ("mixed-text", 200, 0): "5a192c7a2b18c49c",
    ("mixed-text", None, 3): "5332ff0a28c9dfe3",
    ("mixed-multimodal", 200, 0): "ff1dd7ffa77dc150",
    ("shared-prefix", 200, 0): "bd72c1c010a8af4a",
    ("multi-turn", 200, 0): "dc453ee9ee5f020e",
    ("long-context", None, 0): "1dea06a0b5d754c6",
    ("parallel-sampling", 200, 0): "7a94c63c84a42e4a",
}


@pytest.mark.parametrize(("name", "n", "seed"), list(PINNED))
def test_preset_digests_are_unchanged(name: str, n: int | None, seed: int) -> None:
    assert generate_preset(name, n, seed).digest == PINNED[(name, n, seed)]


def test_quick_sim_baseline_digest() -> None:
    record = json.loads((REPO / "results/baselines/any/quick-sim/paged.json").read_text())
    wl = record["workload"]
    assert generate_preset(wl["name"], wl["num_requests"], wl["seed"]).digest == wl["digest"]


def _reference_digest(workload: Workload) -> str:
    h = hashlib.sha256()
    for r in workload.requests:
        h.update(json.dumps(r.to_json(), sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def test_digest_is_sorted_key_json_of_every_request() -> None:
    odd = [
        Request("a", 0, (Segment("text", 3, 'quote"é\n'),), 0),  # int arrival, escapes
        Request("b", 1.5, (
            Segment("image", 576, "img", height=336, width=448, rule="llava-1.5"),
            Segment("audio", 50, "aud", seconds=1.0),
            Segment("text", 1, "t"),
        ), 9, prefix_group="g/0", session_id="session-1", n=4),
        Request("c", 1e-7, (Segment("text", 2**40, "big"),), 2**33, n=1),
    ]
    workloads = [Workload("odd", odd, seed=0)] + [
        generate_preset(name, 300, seed=5) for name in preset_names()
    ]
    workloads.append(import_trace(
        "mooncake", REPO / "tests/fixtures/mooncake_synthetic_trace_head300.jsonl"
    ))
    for w in workloads:
        assert w.digest == _reference_digest(w), w.name


def test_bulk_constructors_build_the_same_frozen_objects() -> None:
    image = new_segment("image", 256, "k", 448, 448, None, "qwen2-vl")
    assert image == Segment("image", 256, "k", height=448, width=448, rule="qwen2-vl")
    assert hash(text_segment(5, "t")) == hash(Segment("text", 5, "t"))
    r = new_request("r0", 1.0, (image, text_segment(5, "t")), 7, "g", "s", 2)
    made = Request("r0", 1.0, (image, Segment("text", 5, "t")), 7, prefix_group="g",
                   session_id="s", n=2)
    assert r == made
    assert r.prompt_tokens == made.prompt_tokens == 261  # kept, not compared
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.n = 3  # type: ignore[misc]


def test_collector_paused_restores_the_collector() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("name", preset_names())
def test_memory_estimate_matches_the_heap(name: str) -> None:
    spec = get_preset_spec(name)
    tracemalloc.start()
    try:
        w = generate(spec, 20_000, seed=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    segments = len({id(s) for r in w.requests for s in r.segments})
    refs = sum(len(r.segments) for r in w.requests)
    estimate = limits.estimate_bytes(len(w), segments, refs)
    assert 0.8 < estimate / peak < 1.25, (estimate, peak)


def test_a_trillion_requests_are_refused_before_any_work() -> None:
    with pytest.raises(KvbenchError, match=r"mixed-text: 1,000,000,000,000 requests would need "
                       r"about .* of memory \(\d+ B each\), more than this machine's"):
        generate_preset("mixed-text", num_requests=1_000_000_000_000)


def test_the_estimate_counts_what_sessions_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 MiB holds about 2,000 one-segment requests (503 B each). Multi-turn prompts repeat
    # their history, so the exact check after drawing refuses 1,800 of them, which passed the
    # first check (at least one segment per request).
    monkeypatch.setattr(limits, "memory_limit_bytes", lambda: 2**20)
    generate_preset("mixed-text", num_requests=1800)
    with pytest.raises(KvbenchError, match=r"more than this machine's 1\.0 MiB; ask for at most "
                       r"about 2,084 requests"):
        generate_preset("mixed-text", num_requests=3000)
    with pytest.raises(KvbenchError, match=r"multi-turn: 1,800 requests would need about "
                       r"1\.1 MiB of memory \(660 B each\)"):
        generate_preset("multi-turn", num_requests=1800)
