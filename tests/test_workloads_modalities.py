"""Image and audio token rules: the published counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbench.errors import KvbenchError
from kvbench.workloads.modalities import IMAGE_RULES, audio_token_count, image_token_count


@pytest.mark.parametrize(
    ("rule", "height", "width", "tokens"),
    [
        ("vit-l14", 224, 224, 257),
        ("vit-l14", 336, 336, 577),
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
