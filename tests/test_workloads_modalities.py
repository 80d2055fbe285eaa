"""Image and audio token rules: the published counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbench.errors import KvbenchError
from kvbench.workloads.modalities import (
    IMAGE_RULES,
    ImageChoice,
    audio_token_count,
    image_token_count,
    parse_image_choice,
)


@pytest.mark.parametrize(
    ("rule", "height", "width", "tokens"),
    [
        # Claim C20 says ViT at 224 → 384 px goes from 197 to 617 tokens: ViT-B/16 gives
        # 197 → 577, and 617 (not a square plus one) is no ViT's count at 384 px.
        ("vit-b16", 224, 224, 197),
        ("vit-b16", 384, 384, 577),
        ("vit-b16", 224, 384, 14 * 24 + 1),
        ("vit-b16", 400, 250, 25 * 15 + 1),  # 250 / 16 = 15.6: the stride floors
        ("vit-l14", 224, 224, 257),
        ("vit-l14", 336, 336, 577),
        ("vit-l14", 384, 384, 27 * 27 + 1),  # 384 / 14 = 27.4: 730
        ("vit-l14", 230, 240, 16 * 17 + 1),  # partial patches dropped
        ("llava-1.5", 336, 336, 576),
        ("llava-1.5", 224, 224, 576),
        ("llava-1.5", 1080, 1920, 576),
        ("llava-next", 672, 672, 2880),
        ("llava-next", 336, 672, 3 * 576),  # 1×2 tiles + base
        ("llava-next", 1008, 336, 4 * 576),  # 3×1 tiles + base
        ("llava-next", 2000, 2100, 5 * 576),
        ("qwen2-vl", 28, 28, 4),  # scaled up to the 4-token minimum
        ("qwen2-vl", 448, 448, 256),
        ("qwen2-vl", 224, 224, 64),
        ("qwen2-vl", 336, 336, 144),
        ("qwen2-vl", 1080, 1920, 39 * 69),  # 1092×1932 after rounding to multiples of 28
        ("qwen2-vl", 8192, 8192, 16384),  # scaled down to the maximum
    ],
)
def test_published_image_counts(rule: str, height: int, width: int, tokens: int) -> None:
    assert image_token_count(rule, height, width) == tokens


@given(h=st.integers(1, 20_000), w=st.integers(1, 20_000))
def test_qwen2_vl_stays_in_its_token_range(h: int, w: int) -> None:
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(KvbenchError, match="aspect ratio"):
            image_token_count("qwen2-vl", h, w)
    else:
        assert 4 <= image_token_count("qwen2-vl", h, w) <= 16384


def test_unknown_rule_lists_valid_names() -> None:
    with pytest.raises(KvbenchError, match="unknown image token rule 'clip'") as e:
        image_token_count("clip", 224, 224)
    for name in IMAGE_RULES:
        assert name in str(e.value)


def test_bad_sizes_rejected() -> None:
    with pytest.raises(KvbenchError, match="positive pixels"):
        image_token_count("llava-1.5", 0, 10)
    with pytest.raises(KvbenchError, match="at least 14"):
        image_token_count("vit-l14", 10, 300)
    with pytest.raises(KvbenchError, match=r"vit-b16 needs images of at least 16×16 px"):
        image_token_count("vit-b16", 300, 15)


@pytest.mark.parametrize(
    ("text", "choice"),
    [
        ("llava-1.5", ImageChoice("llava-1.5", 336, 336, 576)),
        ("vit-b16", ImageChoice("vit-b16", 224, 224, 197)),
        ("vit-b16:384x384", ImageChoice("vit-b16", 384, 384, 577)),
        ("qwen2-vl:448x672", ImageChoice("qwen2-vl", 448, 672, 16 * 24)),
        (" llava-next:672x672 ", ImageChoice("llava-next", 672, 672, 2880)),
    ],
)
def test_image_choice(text: str, choice: ImageChoice) -> None:
    assert parse_image_choice(text) == choice
    assert parse_image_choice(choice.label) == choice


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("qwen2-vl", r"'qwen2-vl' needs a size: qwen2-vl:HxW, e.g. qwen2-vl:448x448"),
        ("qwen2-vl:448", r"is not RULE or RULE:HxW"),
        ("qwen2-vl:448x0", "positive pixels"),
        ("clip:224x224", "unknown image token rule 'clip'"),
        ("vit-l14:10x10", "at least 14"),
    ],
)
def test_bad_image_choices(text: str, message: str) -> None:
    with pytest.raises(KvbenchError, match=message):
        parse_image_choice(text)


def test_audio_counts() -> None:
    assert audio_token_count(30) == 1500  # one Whisper window
    assert audio_token_count(1) == 50
    assert audio_token_count(0.1) == 5
    assert audio_token_count(0.011) == 1
    assert audio_token_count(2, tokens_per_s=25) == 50
    with pytest.raises(KvbenchError, match="> 0 seconds"):
        audio_token_count(0)
    with pytest.raises(KvbenchError, match="tokens per second"):
        audio_token_count(1, tokens_per_s=0)
