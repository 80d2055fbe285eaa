"""Vision and audio encoders that turn image/audio segments into decoder input embeddings.

They are small (random weights, a few layers) but do the real work whose cost and memory
matter to KV experiments: images are resized/tiled by each token rule's geometry, patchified
by a conv and run through transformer layers; audio is framed by a real STFT into log-mel
features and downsampled by a strided conv to 50 tokens/s. The number of embeddings comes
out of that geometry, so a segment whose token count disagrees with its rule is an error.

Content is synthetic and deterministic from the segment key: equal keys give equal pixels,
waveforms and embeddings. Outputs are cached by segment (an image repeated across requests
is encoded once), with an LRU byte limit.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvbench.engines.model.weights import INIT_STD, init_random_
from kvbench.errors import KvbenchError
from kvbench.workloads.modalities import (
    LLAVA_IMAGE_PX,
    VIT_B16_PATCH_PX,
    VIT_PATCH_PX,
    check_image_rule,
    llava_next_canvas,
    qwen2_vl_size,
)
from kvbench.workloads.model import Segment, key_hash

SAMPLE_RATE = 16000
N_FFT = 400  # 25 ms window
HOP = 160  # 10 ms hop: 100 frames/s, halved by the strided conv to 50 tokens/s
N_MELS = 80

WIDTH = 64
HEADS = 4
DEFAULT_CACHE_LIMIT_BYTES = 256 * 2**20


class Encoders:
    """Both encoders (built on first use) and the output cache of one executor."""

    def __init__(
        self,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES,
    ) -> None:
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.cache_limit_bytes = cache_limit_bytes
        self._modules: _EncoderModules | None = None
        self._cache: OrderedDict[Segment, Tensor] = OrderedDict()
        self.cache_bytes = 0

    def embed(self, segment: Segment) -> Tensor:
        """``[segment.tokens, hidden]`` embeddings of an image or audio segment."""
        hit = self._cache.get(segment)
        if hit is not None:
            self._cache.move_to_end(segment)
            return hit
        with torch.inference_mode():
            out = self._encode(segment).to(self.dtype)
        self._cache[segment] = out
        self.cache_bytes += out.nbytes
        while self.cache_bytes > self.cache_limit_bytes and self._cache:
            self.cache_bytes -= self._cache.popitem(last=False)[1].nbytes
        return out

    def clear(self) -> None:
        self._cache.clear()
        self.cache_bytes = 0

    def describe(self) -> dict[str, Any]:
        return {
            "vision": f"ViT width {WIDTH}, 2 layers, {VIT_PATCH_PX}- or {VIT_B16_PATCH_PX}-px "
                      "patches by rule",
            "audio": f"{N_MELS}-bin log-mel, {1000 * HOP // SAMPLE_RATE} ms hop, stride-2 conv",
            "cache_limit_bytes": self.cache_limit_bytes,
        }

    def _encode(self, segment: Segment) -> Tensor:
        modules = self._build()
        if segment.kind == "image":
            if segment.height is None or segment.width is None or segment.rule is None:
                raise KvbenchError(
                    f"image segment {segment.key!r} needs height, width and a token rule"
                )
            pixels = synthetic_image(segment.key, segment.height, segment.width).to(self.device)
            views, patch, cls, merge = image_views(segment.rule, pixels)
            out = modules.vision(views, patch, cls=cls, merge=merge)
            source = f"rule {segment.rule!r} at {segment.height}x{segment.width} px"
        elif segment.kind == "audio":
            if segment.seconds is None:
                raise KvbenchError(f"audio segment {segment.key!r} has no seconds")
            out = modules.audio(synthetic_waveform(segment.key, segment.seconds).to(self.device))
            source = f"{segment.seconds} s of audio at 50 tokens/s"
        else:
            raise KvbenchError(f"segment {segment.key!r} of kind {segment.kind!r} has no encoder")
        if out.shape[0] != segment.tokens:
            raise KvbenchError(
                f"{segment.kind} segment {segment.key!r}: {source} gives {out.shape[0]} tokens "
                f"but the segment has {segment.tokens}"
            )
        return out

    def _build(self) -> _EncoderModules:
        if self._modules is None:
            # Initialised on the CPU so the weights are the same whatever the device.
            modules = _EncoderModules(self.hidden_size)
            with torch.no_grad():
                init_random_(modules, self.seed, _encoder_std)
            self._modules = modules.to(self.device).eval().requires_grad_(False)
        return self._modules


def _encoder_std(name: str) -> float | None:
    return None if name.endswith("norm.weight") else INIT_STD


# --- content ---------------------------------------------------------------------------


def _generator(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(key_hash(key) & (2**63 - 1))


def synthetic_image(key: str, height: int, width: int) -> Tensor:
    """``[3, height, width]`` normalised pixels, deterministic from ``key``."""
    # In place: the same values without two more image-sized tensors.
    return torch.rand(3, height, width, generator=_generator(key)).sub_(0.5).div_(0.25)


def synthetic_waveform(key: str, seconds: float) -> Tensor:
    """A 16 kHz waveform (a few tones plus noise), deterministic from ``key``."""
    gen = _generator(key)
    t = torch.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    freqs = 100 + 3000 * torch.rand(3, 1, generator=gen)
    phases = 2 * math.pi * torch.rand(3, 1, generator=gen)
    tones = torch.sin(2 * math.pi * freqs * t + phases).sum(0)
    return 0.1 * tones + 0.01 * torch.randn(t.shape[0], generator=gen)


# --- image geometry --------------------------------------------------------------------


def image_views(rule: str, pixels: Tensor) -> tuple[Tensor, int, bool, bool]:
    """The encoder inputs for ``pixels`` ``[3, H, W]`` under ``rule`` (geometry from
    :mod:`kvbench.workloads.modalities`): views ``[N, 3, h, w]``, the patch size in pixels,
    whether a CLS token is kept, whether patches are merged 2x2."""
    _, h, w = pixels.shape
    check_image_rule(rule)
    if rule in ("vit-l14", "vit-b16"):
        # Native resolution; the conv drops partial patches at the edges.
        patch = VIT_PATCH_PX if rule == "vit-l14" else VIT_B16_PATCH_PX
        return pixels[None], patch, True, False
    if rule == "llava-1.5":
        return _square(pixels, LLAVA_IMAGE_PX)[None], VIT_PATCH_PX, False, False
    if rule == "llava-next":
        ch, cw = llava_next_canvas(h, w)
        tile = LLAVA_IMAGE_PX
        tiles = _fit(pixels, ch, cw).unfold(1, tile, tile).unfold(2, tile, tile)
        tiles = tiles.permute(1, 2, 0, 3, 4).reshape(-1, 3, tile, tile)
        # The downscaled whole image comes first, then the tiles row by row.
        return torch.cat([_square(pixels, tile)[None], tiles]), VIT_PATCH_PX, False, False
    rh, rw = qwen2_vl_size(h, w)
    return _resize(pixels, rh, rw)[None], VIT_PATCH_PX, False, True


def _resize(pixels: Tensor, height: int, width: int) -> Tensor:
    if pixels.shape[1:] == (height, width):
        return pixels
    return F.interpolate(pixels[None], size=(height, width), mode="bilinear")[0]


def _fit(pixels: Tensor, height: int, width: int) -> Tensor:
    """Resize keeping the aspect ratio, then pad (centred, zeros) to ``height x width``."""
    _, h, w = pixels.shape
    scale = min(height / h, width / w)
    nh, nw = min(height, max(1, round(h * scale))), min(width, max(1, round(w * scale)))
    top, left = (height - nh) // 2, (width - nw) // 2
    return F.pad(_resize(pixels, nh, nw), (left, width - nw - left, top, height - nh - top))


def _square(pixels: Tensor, size: int) -> Tensor:
    return _fit(pixels, size, size)


# --- modules ---------------------------------------------------------------------------


class _Block(nn.Module):
    """Pre-norm transformer layer with bidirectional attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, length, width = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(n, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, length, width)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


def _projector(width: int, hidden_size: int) -> nn.Sequential:
    """LLaVA-style two-layer MLP into the decoder's embedding space."""
    return nn.Sequential(
        nn.Linear(width, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size)
    )


def _sincos_2d(gh: int, gw: int, width: int, device: torch.device) -> Tensor:
    """Fixed 2-D position embeddings ``[gh * gw, width]``: any grid size, no interpolation."""
    quarter = width // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, device=device) / quarter)
    y, x = torch.meshgrid(
        torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij"
    )
    ay, ax = y.reshape(-1, 1) * omega, x.reshape(-1, 1) * omega
    return torch.cat([ay.sin(), ay.cos(), ax.sin(), ax.cos()], dim=1)


class VisionEncoder(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, WIDTH, VIT_PATCH_PX, stride=VIT_PATCH_PX)
        self.patch_embed16 = nn.Conv2d(3, WIDTH, VIT_B16_PATCH_PX, stride=VIT_B16_PATCH_PX)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.blocks = nn.ModuleList(_Block(WIDTH, HEADS) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.merge = nn.Linear(4 * WIDTH, WIDTH)
        self.projector = _projector(WIDTH, hidden_size)

    def forward(self, views: Tensor, patch: int, cls: bool, merge: bool) -> Tensor:
        """``[N, 3, h, w]`` -> ``[tokens, hidden]``, the views' tokens back to back."""
        embed = self.patch_embed16 if patch == VIT_B16_PATCH_PX else self.patch_embed
        x = embed(views)
        n, _, gh, gw = x.shape
        x = x.flatten(2).transpose(1, 2) + _sincos_2d(gh, gw, WIDTH, x.device)
        if cls:
            x = torch.cat([self.cls_token.expand(n, 1, WIDTH), x], dim=1)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if merge:
            # Each 2x2 neighbourhood of patches becomes one token (Qwen2-VL's merger).
            x = x.view(n, gh // 2, 2, gw // 2, 2, WIDTH).permute(0, 1, 3, 2, 4, 5)
            x = self.merge(x.reshape(n, (gh // 2) * (gw // 2), 4 * WIDTH))
        return self.projector(x).flatten(0, 1)


def _mel_filters() -> Tensor:
    """Triangular mel filterbank ``[N_MELS, N_FFT // 2 + 1]`` (HTK mel scale, 0-8 kHz)."""

    def mel(hz: Tensor) -> Tensor:
        return 2595 * torch.log10(1 + hz / 700)

    bins = torch.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    top = float(mel(torch.tensor(SAMPLE_RATE / 2)))
    edges = 700 * (10 ** (torch.linspace(0, top, N_MELS + 2) / 2595) - 1)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising, falling = (bins - lo) / (mid - lo), (hi - bins) / (hi - mid)
    return torch.minimum(rising, falling).clamp_min(0)


class AudioEncoder(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(N_MELS, WIDTH, 3, padding=1)
        self.conv2 = nn.Conv1d(WIDTH, WIDTH, 3, stride=2, padding=1)
        self.block = _Block(WIDTH, HEADS)
        self.norm = nn.LayerNorm(WIDTH)
        self.projector = _projector(WIDTH, hidden_size)
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.register_buffer("mel", _mel_filters(), persistent=False)

    def features(self, waveform: Tensor) -> Tensor:
        """Whisper-style log-mel ``[N_MELS, ceil(samples / HOP)]``."""
        # A partial last hop counts as a frame (zero-padded); the centred STFT's final frame
        # then covers only padding and is dropped, as Whisper does.
        waveform = F.pad(waveform, (0, -waveform.shape[0] % HOP))
        spec = torch.stft(
            waveform, N_FFT, HOP, window=self.window, center=True, pad_mode="constant",
            return_complex=True,
        )
        power = spec[:, :-1].abs() ** 2
        logmel = torch.log10((self.mel @ power).clamp_min(1e-10))
        return (torch.maximum(logmel, logmel.max() - 8.0) + 4.0) / 4.0

    def forward(self, waveform: Tensor) -> Tensor:
        """``[samples]`` at 16 kHz -> ``[ceil(samples / HOP / 2), hidden]``: 50 tokens/s."""
        x = F.gelu(self.conv1(self.features(waveform)[None]))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        return self.projector(self.norm(self.block(x)))[0]


class _EncoderModules(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.vision = VisionEncoder(hidden_size)
        self.audio = AudioEncoder(hidden_size)
