"""Vision and audio encoders: token counts come out of each rule's real geometry."""

from __future__ import annotations

import pytest
import torch

from kvbench.engines.model.encoders import Encoders, image_views, synthetic_image
from kvbench.errors import KvbenchError
from kvbench.workloads.modalities import (
    audio_token_count,
    image_token_count,
    llava_next_canvas,
    qwen2_vl_size,
)
from kvbench.workloads.model import Segment

HIDDEN = 32
CPU = torch.device("cpu")

# Published counts at square sizes (LLaVA-NeXT: base image + 2 or 4 tiles of 576).
EXPECTED = {
    "vit-l14": {224: 257, 336: 577, 448: 1025},
    "vit-b16": {224: 197, 336: 442, 448: 785},
    "llava-1.5": {224: 576, 336: 576, 448: 576},
    "llava-next": {224: 1728, 336: 1728, 448: 2880},
    "qwen2-vl": {224: 64, 336: 144, 448: 256},
}


@pytest.fixture(scope="module")
def encoders() -> Encoders:
    return Encoders(HIDDEN, CPU, torch.float32, seed=0)


def image(rule: str, height: int, width: int, tokens: int, key: str = "img/a") -> Segment:
    return Segment("image", tokens, key, height=height, width=width, rule=rule)


@pytest.mark.parametrize("rule", sorted(EXPECTED))
@pytest.mark.parametrize("size", [224, 336, 448])
def test_image_tokens_follow_rule(encoders, rule, size):
    tokens = EXPECTED[rule][size]
    assert image_token_count(rule, size, size) == tokens
    out = encoders.embed(image(rule, size, size, tokens, key=f"img/{rule}/{size}"))
    assert out.shape == (tokens, HIDDEN)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("rule", sorted(EXPECTED))
@pytest.mark.parametrize(("height", "width"), [(300, 500), (1000, 250), (50, 700), (29, 31)])
def test_geometry_agrees_with_workload_rules(rule, height, width):
    """Counted from the views the encoder sees, without running it."""
    views, patch, cls, merge = image_views(rule, synthetic_image("k", height, width))
    gh, gw = views.shape[2] // patch, views.shape[3] // patch
    per_view = gh * gw // 4 if merge else gh * gw
    assert views.shape[0] * per_view + int(cls) == image_token_count(rule, height, width)


def test_geometry_details():
    assert llava_next_canvas(672, 672) == (672, 672)
    assert llava_next_canvas(300, 900) == (336, 1008)
    assert qwen2_vl_size(10, 10) == (56, 56)  # min 4 tokens
    h, w = qwen2_vl_size(8000, 8000)  # capped at 16384 tokens
    assert (h // 28) * (w // 28) <= 16384
    views, _, _, _ = image_views("llava-next", synthetic_image("k", 672, 672))
    assert views.shape == (5, 3, 336, 336)


@pytest.mark.parametrize("seconds", [0.5, 1.0, 2.3, 0.33, 0.025])
def test_audio_tokens_at_50_per_second(encoders, seconds):
    tokens = audio_token_count(seconds)
    out = encoders.embed(Segment("audio", tokens, f"aud/{seconds}", seconds=seconds))
    assert out.shape == (tokens, HIDDEN)


def test_outputs_are_deterministic_and_keyed():
    a = Encoders(HIDDEN, CPU, torch.float32, seed=0)
    b = Encoders(HIDDEN, CPU, torch.float32, seed=0)
    seg = image("qwen2-vl", 56, 84, 6)
    assert torch.equal(a.embed(seg), b.embed(seg))
    assert not torch.equal(a.embed(seg), a.embed(image("qwen2-vl", 56, 84, 6, key="img/b")))
    clip = Segment("audio", 10, "aud/x", seconds=0.2)
    assert torch.equal(a.embed(clip), b.embed(clip))


def test_cache_hits_and_lru_limit():
    enc = Encoders(HIDDEN, CPU, torch.float32, seed=0)
    first = enc.embed(image("qwen2-vl", 56, 56, 4, key="img/1"))
    assert enc.embed(image("qwen2-vl", 56, 56, 4, key="img/1")) is first
    assert enc.cache_bytes == first.nbytes
    enc.cache_limit_bytes = 2 * first.nbytes
    enc.embed(image("qwen2-vl", 56, 56, 4, key="img/2"))
    enc.embed(image("qwen2-vl", 56, 56, 4, key="img/3"))  # evicts img/1
    assert enc.cache_bytes == 2 * first.nbytes
    assert enc.embed(image("qwen2-vl", 56, 56, 4, key="img/1")) is not first
    enc.clear()
    assert enc.cache_bytes == 0


def test_output_dtype_follows_decoder():
    enc = Encoders(HIDDEN, CPU, torch.bfloat16, seed=0)
    out = enc.embed(image("qwen2-vl", 56, 56, 4))
    assert out.dtype == torch.bfloat16 and enc.cache_bytes == 4 * HIDDEN * 2


def test_token_count_disagreeing_with_rule_is_an_error(encoders):
    with pytest.raises(KvbenchError, match=r"rule 'vit-l14' at 224x224 px gives 257 tokens"):
        encoders.embed(image("vit-l14", 224, 224, 256, key="img/wrong"))
    with pytest.raises(KvbenchError, match="gives 50 tokens but the segment has 49"):
        encoders.embed(Segment("audio", 49, "aud/wrong", seconds=1.0))


def test_bad_segments(encoders):
    with pytest.raises(KvbenchError, match="unknown image token rule 'clip-b16'"):
        encoders.embed(image("clip-b16", 224, 224, 197))
    with pytest.raises(KvbenchError, match="needs height, width and a token rule"):
        encoders.embed(Segment("image", 4, "img/x", rule="qwen2-vl"))
    with pytest.raises(KvbenchError, match="needs height, width and a token rule"):
        encoders.embed(Segment("image", 4, "img/x", height=56, width=56))
    with pytest.raises(KvbenchError, match="no seconds"):
        encoders.embed(Segment("audio", 4, "aud/x"))
