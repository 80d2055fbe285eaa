"""The workload generator and the named presets."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import numpy as np
import pytest

from kvbench.errors import KvbenchError
from kvbench.workloads.generator import generate
from kvbench.workloads.modalities import image_token_count
from kvbench.workloads.presets import generate_preset, get_preset_spec, preset_names
from kvbench.workloads.spec import WorkloadSpec, parse_spec

VOCAB = 32_000

SESSION_SPEC = {
    "arrival": {"kind": "poisson", "rate": 2.0},
    "classes": [
        {
            "name": "chat",
            "prefix": {"templates": 2, "tokens": {"kind": "fixed", "value": 40}},
            "session": {"turns": {"kind": "uniform", "low": 2, "high": 4}, "think_time_s": 3.0},
            "images": {"count": {"kind": "fixed", "value": 1}, "sizes": [[448, 448]],
                       "rule": "qwen2-vl"},
            "prompt": {"kind": "uniform", "low": 5, "high": 30},
            "output": {"kind": "uniform", "low": 5, "high": 30},
        },
        {
            "name": "single",
            "weight": 2,
            "n": 3,
            "audio": {"seconds": {"kind": "uniform", "low": 1, "high": 4}},
            "prompt": {"kind": "fixed", "value": 12},
            "output": {"kind": "fixed", "value": 7},
        },
    ],
}


def test_same_seed_same_digest_other_seed_other_digest() -> None:
    spec = parse_spec(SESSION_SPEC, "test")
    a, b, c = generate(spec, 60, seed=5), generate(spec, 60, seed=5), generate(spec, 60, seed=6)
    assert a.digest == b.digest and a.requests == b.requests
    assert a.digest != c.digest
    assert all(s.key.startswith("s5/") for r in a.requests for s in r.segments)


def test_requests_sorted_by_arrival_with_stable_ids() -> None:
    w = generate(parse_spec(SESSION_SPEC, "test"), 80, seed=1)
    assert len(w) == 80
    assert [r.id for r in w.requests] == [f"r{i}" for i in range(80)]
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0


def test_multi_turn_prompt_extends_previous_turn() -> None:
    w = generate(parse_spec(SESSION_SPEC, "test"), 80, seed=2)
    sessions = defaultdict(list)
    for r in w.requests:
        if r.session_id is not None:
            sessions[r.session_id].append(r)
    assert any(len(turns) >= 3 for turns in sessions.values())
    for turns in sessions.values():
        for t, (prev, nxt) in enumerate(pairwise(turns)):
            ids_prev, ids_next = prev.prompt_token_ids(VOCAB), nxt.prompt_token_ids(VOCAB)
            assert np.array_equal(ids_next[: len(ids_prev)], ids_prev)
            answer = nxt.segments[len(prev.segments)]
            assert answer.tokens == prev.output_tokens
            assert answer.key.endswith(f"/out/{t}")
            assert nxt.arrival_s >= prev.arrival_s
            assert nxt.prefix_group == prev.prefix_group


def test_shared_prefix_ids_equal_within_a_template_only() -> None:
    w = generate(parse_spec(SESSION_SPEC, "test"), 80, seed=3)
    firsts = defaultdict(set)
    for r in w.requests:
        if r.prefix_group is not None:
            firsts[r.prefix_group].add(tuple(r.prompt_token_ids(VOCAB)[:40].tolist()))
    assert set(firsts) == {"chat/0", "chat/1"}
    assert all(len(v) == 1 for v in firsts.values())
    assert firsts["chat/0"] != firsts["chat/1"]


def test_media_and_parallel_samples() -> None:
    w = generate(parse_spec(SESSION_SPEC, "test"), 80, seed=4)
    singles = [r for r in w.requests if r.session_id is None]
    assert singles and all(r.n == 3 and r.output_tokens == 7 for r in singles)
    for r in singles:
        (audio,) = [s for s in r.segments if s.kind == "audio"]
        assert audio.tokens == 50 * audio.seconds and 1 <= audio.seconds <= 4
    images = [s for r in w.requests for s in r.segments if s.kind == "image"]
    assert images and all(
        s.tokens == image_token_count("qwen2-vl", 448, 448) and s.rule == "qwen2-vl"
        for s in images
    )


def test_class_weights_mix() -> None:
    spec = parse_spec({
        "classes": [
            {"name": "a", "weight": 3, "prompt": {"kind": "fixed", "value": 1},
             "output": {"kind": "fixed", "value": 1}},
            {"name": "b", "weight": 1, "prompt": {"kind": "fixed", "value": 2},
             "output": {"kind": "fixed", "value": 1}},
        ]
    }, "test")
    w = generate(spec, 4000, seed=0)
    share_a = sum(r.prompt_tokens == 1 for r in w.requests) / len(w)
    assert abs(share_a - 0.75) < 0.03


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"classes": []}, "at least 1 item"),
        ({"arrival": {"kind": "poisson", "rate": 0}}, 'use kind = "offline"'),
        ({"classes": [{**SESSION_SPEC["classes"][1], "name": "a/b"}]}, "may hold only"),
        ({"classes": [SESSION_SPEC["classes"][1]] * 2}, "repeated: single"),
        ({"classes": [{**SESSION_SPEC["classes"][1], "prompt": {"kind": "fixed", "value": 3,
                                                                "min": 0}}]},
         "prompt tokens must be at least 1"),
        ({"classes": [{**SESSION_SPEC["classes"][0],
                       "images": {"count": {"kind": "fixed", "value": 1}, "sizes": [[9, 9]],
                                  "rule": "vit-l14"}}]}, "at least 14"),
        ({"classes": [{**SESSION_SPEC["classes"][1], "colour": "red"}]}, "Extra inputs"),
    ],
)
def test_bad_specs_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(KvbenchError, match=f"suite.toml: invalid workload spec: .*{message}"):
        parse_spec({**SESSION_SPEC, **change}, "suite.toml")


def test_preset_names_and_unknown_preset() -> None:
    names = preset_names()
    for required in ("mixed-text", "mixed-multimodal", "shared-prefix", "multi-turn",
                     "long-context", "parallel-sampling", "multimodal-reuse"):
        assert required in names
    with pytest.raises(KvbenchError, match="unknown workload preset 'nope'; valid: mixed-text"):
        get_preset_spec("nope")


@pytest.mark.parametrize("name", preset_names())
def test_presets_fit_the_tiny_model(name: str) -> None:
    w = generate_preset(name, num_requests=1500, seed=11)
    assert len(w) == 1500 and w.source == f"preset {name}" and w.name == name
    limit = 4096 if name == "long-context" else 2048
    assert max(r.prompt_tokens + r.output_tokens for r in w.requests) <= limit


def test_preset_shapes() -> None:
    mm = generate_preset("mixed-multimodal", 400)
    rules = {s.rule for r in mm.requests for s in r.segments if s.kind == "image"}
    assert rules == {"vit-l14", "llava-1.5", "qwen2-vl"}
    assert any(r.tokens_of("audio") for r in mm.requests)
    assert all(r.n > 1 for r in generate_preset("parallel-sampling").requests)
    assert all(r.session_id for r in generate_preset("multi-turn").requests)
    assert all(r.prefix_group for r in generate_preset("shared-prefix").requests)
    assert min(r.prompt_tokens for r in generate_preset("long-context").requests) >= 2048
    assert generate_preset("mixed-text").digest == generate_preset("mixed-text", seed=0).digest
    assert len(generate_preset("mixed-text")) == get_preset_spec("mixed-text").num_requests


def test_recorded_spec_regenerates_the_same_workload() -> None:
    w = generate_preset("shared-prefix", num_requests=30, seed=2)
    again = generate(WorkloadSpec.model_validate(w.spec), len(w), w.seed)
    assert again.digest == w.digest


def test_trace_arrivals_give_session_starts() -> None:
    spec = parse_spec({
        **SESSION_SPEC,
        "classes": SESSION_SPEC["classes"][:1],
        "arrival": {"kind": "trace", "timestamps_s": [5.0, 6.0, 9.0, 20.0, 21.0]},
    }, "test")
    w = generate(spec, 10, seed=0)  # 2–4 turns per session: at most 5 starts needed
    starts = sorted({r.session_id: r.arrival_s for r in reversed(w.requests)}.values())
    assert starts == [0.0, 1.0, 4.0, 15.0, 16.0][: len(starts)]
