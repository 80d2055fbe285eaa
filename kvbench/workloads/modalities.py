"""How many KV positions an image or an audio clip occupies, by named rule.

Each rule is the geometry of a published model's vision front end, so a vision encoder built
to a rule must produce exactly the count given here. Sizes are in pixels, ``height`` first.

The plain ViT rules run the encoder at the image's own size: ``vit-b16`` (ViT-B/16, 16-px
patches) and ``vit-l14`` (CLIP ViT-L/14, 14-px patches), each with one CLS token. The patch
embedding is a convolution whose stride is the patch size, so a side that is not a multiple
of the patch is floored: the edge pixels that do not fill a patch are dropped. Hence
ViT-B/16 gives 224 px → 14² + 1 = 197 and 384 px → 24² + 1 = 577 tokens; ViT-L/14 gives
224 → 257, 336 → 577 and 384 → ⌊384 / 14⌋ = 27, 27² + 1 = 730.

Where one rule and size stand for every image (a trace that only counts images), the choice is
written ``RULE[:HxW]`` (``parse_image_choice``): ``qwen2-vl:448x448`` is 448 px high and 448
wide; the size may be left out for the rules with a native input size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvbench.errors import KvbenchError

# CLIP ViT-L/14: 14-px patches, one CLS token.
VIT_PATCH_PX = 14
# ViT-B/16: 16-px patches, one CLS token.
VIT_B16_PATCH_PX = 16
# LLaVA-1.5 feeds CLIP ViT-L/14-336 a 336×336 image and keeps the 24×24 patch features.
LLAVA_IMAGE_PX = 336
LLAVA_TOKENS_PER_TILE = (LLAVA_IMAGE_PX // VIT_PATCH_PX) ** 2  # 576
# LLaVA-NeXT (v1.6) any-res candidate canvases, (height, width), from its `image_grid_pinpoints`.
LLAVA_NEXT_PINPOINTS: tuple[tuple[int, int], ...] = (
    (336, 672),
    (672, 336),
    (672, 672),
    (1008, 336),
    (336, 1008),
)
# Qwen2-VL: 14-px patches merged 2×2, so one token per 28×28 px; 4..16384 tokens per image.
QWEN2_VL_FACTOR_PX = 28
QWEN2_VL_MIN_TOKENS = 4
QWEN2_VL_MAX_TOKENS = 16384
QWEN2_VL_MAX_ASPECT = 200
# Whisper's encoder: 100 mel frames per second, halved by a stride-2 convolution.
WHISPER_TOKENS_PER_S = 50.0


def _vit(name: str, patch: int, height: int, width: int) -> int:
    """A ViT run at the image's own size (interpolated position embeddings).

    The stride-``patch`` convolution covers ``height // patch`` × ``width // patch`` patches
    (edge pixels that do not fill a patch are dropped), plus one CLS token. Images smaller
    than one patch are rejected.
    """
    if height < patch or width < patch:
        raise KvbenchError(
            f"{name} needs images of at least {patch}×{patch} px (got {height}×{width})"
        )
    return (height // patch) * (width // patch) + 1


def _vit_l14(height: int, width: int) -> int:
    """CLIP ViT-L/14: 224 px → 16×16 + 1 = 257, 336 px → 24×24 + 1 = 577."""
    return _vit("vit-l14", VIT_PATCH_PX, height, width)


def _vit_b16(height: int, width: int) -> int:
    """ViT-B/16: 224 px → 14×14 + 1 = 197, 384 px → 24×24 + 1 = 577."""
    return _vit("vit-b16", VIT_B16_PATCH_PX, height, width)


def _llava_15(height: int, width: int) -> int:
    """LLaVA-1.5: any image is resized to 336×336 for CLIP ViT-L/14-336.

    The language model receives the 24×24 = 576 patch features of the penultimate layer; the
    CLS token is dropped. The count does not depend on the image size.
    """
    return LLAVA_TOKENS_PER_TILE


def llava_next_canvas(height: int, width: int) -> tuple[int, int]:
    """The any-res canvas for an image: the pinpoint that keeps the most of the image's pixels
    once it is scaled to fit (never counting more than it has), ties going to the smallest
    canvas, then to the earlier pinpoint."""
    best: tuple[int, int] = LLAVA_NEXT_PINPOINTS[0]
    best_kept, best_wasted = -1, 0
    for canvas_h, canvas_w in LLAVA_NEXT_PINPOINTS:
        scale = min(canvas_w / width, canvas_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = canvas_h * canvas_w - kept
        if kept > best_kept or (kept == best_kept and wasted < best_wasted):
            best, best_kept, best_wasted = (canvas_h, canvas_w), kept, wasted
    return best


def _llava_next(height: int, width: int) -> int:
    """LLaVA-NeXT (v1.6) any-res with 336-px tiles.

    The image is scaled to fit the best canvas among the pinpoints 336×672, 672×336, 672×672,
    1008×336 and 336×1008 (see ``llava_next_canvas``), the canvas is cut into 336×336 tiles,
    and a 336×336 resize of the whole image is added as the base tile. Each tile gives 576
    tokens (LLaVA-1.5 geometry): 672×672 → (4 + 1) × 576 = 2880.

    The reference model then removes feature rows/columns that fall on padding ("unpad") and
    appends one newline token per feature row; this rule counts whole tiles without either,
    so it is the paper's "up to 2880 tokens" figure and exact for images that fill the canvas.
    """
    canvas_h, canvas_w = llava_next_canvas(height, width)
    tiles = (canvas_h // LLAVA_IMAGE_PX) * (canvas_w // LLAVA_IMAGE_PX)
    return (tiles + 1) * LLAVA_TOKENS_PER_TILE


def qwen2_vl_size(height: int, width: int) -> tuple[int, int]:
    """The size Qwen2-VL's processor resizes an image to (naive dynamic resolution).

    Each side is rounded to the nearest multiple of 28 px (half to even, at least 28). If that
    exceeds 16384 × 28² pixels both sides are scaled down by the same factor and floored to
    multiples of 28; if it is under 4 × 28² pixels they are scaled up and ceiled. Aspect ratios
    above 200:1 are rejected, as the reference processor does.
    """
    f = QWEN2_VL_FACTOR_PX
    if max(height, width) / min(height, width) > QWEN2_VL_MAX_ASPECT:
        raise KvbenchError(
            f"qwen2-vl rejects aspect ratios above {QWEN2_VL_MAX_ASPECT}:1 (got {height}×{width})"
        )
    h = max(f, round(height / f) * f)
    w = max(f, round(width / f) * f)
    max_px = QWEN2_VL_MAX_TOKENS * f * f
    min_px = QWEN2_VL_MIN_TOKENS * f * f
    if h * w > max_px:
        beta = math.sqrt(height * width / max_px)
        h = math.floor(height / beta / f) * f
        w = math.floor(width / beta / f) * f
    elif h * w < min_px:
        beta = math.sqrt(min_px / (height * width))
        h = math.ceil(height * beta / f) * f
        w = math.ceil(width * beta / f) * f
    return h, w


def _qwen2_vl(height: int, width: int) -> int:
    """Qwen2-VL: the vision transformer cuts the resized image (``qwen2_vl_size``) into 14-px
    patches and merges each 2×2 group into one token, so the count is ``(h / 28) × (w / 28)``:
    28×28 → 56×56 → 4 tokens, 448×448 → 256 tokens."""
    h, w = qwen2_vl_size(height, width)
    return (h // QWEN2_VL_FACTOR_PX) * (w // QWEN2_VL_FACTOR_PX)


_RULES: dict[str, Callable[[int, int], int]] = {
    "vit-b16": _vit_b16,
    "vit-l14": _vit_l14,
    "llava-1.5": _llava_15,
    "llava-next": _llava_next,
    "qwen2-vl": _qwen2_vl,
}
IMAGE_RULES: tuple[str, ...] = tuple(_RULES)


def check_image_rule(rule: str) -> str:
    """``rule`` if it is a known image rule, else an error listing the valid names."""
    if rule not in _RULES:
        raise KvbenchError(
            f"unknown image token rule {rule!r}; valid rules: {', '.join(IMAGE_RULES)}"
        )
    return rule


def image_token_count(rule: str, height: int, width: int) -> int:
    """KV positions taken by one ``height``×``width`` px image under the named rule."""
    fn = _RULES[check_image_rule(rule)]
    if height <= 0 or width <= 0:
        raise KvbenchError(f"image size must be positive pixels (got {height}×{width})")
    return fn(height, width)


# The input size a rule's model is trained at, used when a choice gives no size.
NATIVE_SIZE_PX: dict[str, int] = {"vit-b16": 224, "vit-l14": 224, "llava-1.5": LLAVA_IMAGE_PX}
_CHOICE = re.compile(r"([a-z0-9.-]+)(?::(\d+)x(\d+))?")


@dataclass(frozen=True, slots=True)
class ImageChoice:
    """One image rule at one size, and the tokens it gives."""

    rule: str
    height: int
    width: int
    tokens: int

    @property
    def label(self) -> str:
        return f"{self.rule}:{self.height}x{self.width}"


def parse_image_choice(text: str) -> ImageChoice:
    """``RULE[:HxW]``, e.g. ``llava-1.5``, ``qwen2-vl:448x448``, ``vit-b16:384x384``."""
    m = _CHOICE.fullmatch(text.strip())
    if m is None:
        raise KvbenchError(
            f"image rule {text!r} is not RULE or RULE:HxW (e.g. qwen2-vl:448x448, height "
            "first); rules: " + ", ".join(IMAGE_RULES)
        )
    rule = check_image_rule(m[1])
    if m[2] is None:
        if rule not in NATIVE_SIZE_PX:
            raise KvbenchError(
                f"image rule {rule!r} needs a size: {rule}:HxW, e.g. {rule}:448x448 "
                "(height first)"
            )
        height = width = NATIVE_SIZE_PX[rule]
    else:
        height, width = int(m[2]), int(m[3])
    return ImageChoice(rule, height, width, image_token_count(rule, height, width))


def audio_token_count(seconds: float, tokens_per_s: float = WHISPER_TOKENS_PER_S) -> int:
    """KV positions taken by ``seconds`` of audio at ``tokens_per_s`` encoder frames.

    The default is Whisper's encoder rate (50 per second: 10 ms mel hop, stride-2 conv). Partial
    frames count as one (ceil). Clips are not padded to Whisper's 30 s window: audio-language
    models keep only the frames of the actual clip.
    """
    if seconds <= 0:
        raise KvbenchError(f"audio length must be > 0 seconds (got {seconds})")
    if tokens_per_s <= 0:
        raise KvbenchError(f"audio tokens per second must be > 0 (got {tokens_per_s})")
    # Rounding first keeps float noise (0.1 s × 50 = 5.000000000000001) from adding a frame.
    return math.ceil(round(seconds * tokens_per_s, 6))
