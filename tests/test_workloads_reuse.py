"""The ``multimodal-reuse`` preset and image catalogues (``images.pool``): reused images are
the same content everywhere, so token ids, prefix-cache block hashes and encoder-cache keys
match."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.engines.kv.hashing import ROOT_HASH, BlockHasher
from kvbench.workloads.generator import generate
from kvbench.workloads.presets import generate_preset
from kvbench.workloads.spec import parse_spec
from kvbench.workloads.stats import describe

VOCAB = 32_000
BLOCK = 16


def _by_class(w):
    chats = defaultdict(list)
    catalogue = []
    for r in w.requests:
        if r.session_id is not None:
            chats[r.session_id].append(r)
        else:
            catalogue.append(r)
    return chats, catalogue


def test_chat_turns_repeat_one_image_after_one_prefix() -> None:
    w = generate_preset("multimodal-reuse", 400, seed=1)
    chats, _ = _by_class(w)
    assert len(chats) > 20 and max(len(t) for t in chats.values()) >= 4
    prefixes = set()
    for turns in chats.values():
        prefix, image = turns[0].segments[:2]
        assert prefix.kind == "text" and image.kind == "image" and image.rule == "qwen2-vl"
        prefixes.add(prefix)
        head = turns[0].prompt_token_ids(VOCAB)[: prefix.tokens + image.tokens]
        for r in turns:
            assert r.segments[:2] == (prefix, image)  # same key, size and position
            assert np.array_equal(r.prompt_token_ids(VOCAB)[: len(head)], head)
    assert len(prefixes) == 1  # one system prompt for every chat
    images = {turns[0].segments[1].key for turns in chats.values()}
    assert len(images) == len(chats)  # each chat is about its own image


def test_catalogue_images_are_shared_content() -> None:
    w = generate_preset("multimodal-reuse", 800, seed=1)
    _, catalogue = _by_class(w)
    by_key = defaultdict(list)
    for r in catalogue:
        (image,) = [s for s in r.segments if s.kind == "image"]
        assert r.segments.index(image) == 1  # right after the shared prefix
        by_key[image.key].append((r, image))
    assert 10 <= len(by_key) <= 16 and len(catalogue) > 200
    hasher = BlockHasher(BLOCK)
    for uses in by_key.values():
        first_r, first = uses[0]
        assert {(s.tokens, s.height, s.width) for _, s in uses} == {
            (first.tokens, first.height, first.width)
        }
        assert all(s == first for _, s in uses)  # equal Segments: one encoder-cache entry
        full = (first_r.segments[0].tokens + first.tokens) // BLOCK * BLOCK
        want = hasher.chain(ROOT_HASH, first_r.prompt_token_ids(VOCAB)[:full])
        for r, _ in uses[1:]:
            assert hasher.chain(ROOT_HASH, r.prompt_token_ids(VOCAB)[:full]) == want


def test_a_pool_draws_sizes_once_and_keeps_keys_per_seed() -> None:
    spec = parse_spec({"classes": [{
        "name": "shop", "prompt": {"kind": "fixed", "value": 4},
        "output": {"kind": "fixed", "value": 4},
        "images": {"count": {"kind": "uniform", "low": 0, "high": 3, "min": 0}, "pool": 3,
                   "sizes": [[224, 224], [448, 448]], "rule": "qwen2-vl"},
    }]}, "test")
    w = generate(spec, 300, seed=9)
    images = [s for r in w.requests for s in r.segments if s.kind == "image"]
    keys = {s.key for s in images}
    assert keys == {f"s9/image-pool/shop/{i}" for i in range(3)}
    assert len({(s.key, s.height) for s in images}) == 3
    assert any(len([s for s in r.segments if s.kind == "image"]) == 0 for r in w.requests)
    assert generate(spec, 300, seed=9).digest == w.digest
    assert {s.key for r in generate(spec, 50, seed=2).requests for s in r.segments
            if s.kind == "image"} <= {f"s2/image-pool/shop/{i}" for i in range(3)}


def test_show_reports_a_high_shareable_prefix_fraction() -> None:
    w = generate_preset("multimodal-reuse")
    fraction = describe(w)["shareable_prefix_fraction"]
    assert fraction > 0.65
    # The same workload without reuse: new images everywhere, no sessions.
    plain = generate_preset("mixed-multimodal")
    assert describe(plain)["shareable_prefix_fraction"] < 0.1
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["workload", "show",
                                                           "multimodal-reuse"])
    assert result.exit_code == 0, result.output
    shown = re.search(r"shareable_prefix_fraction\s+│ ([0-9.]+)", result.output)
    assert shown and float(shown[1]) == round(fraction, 4)
