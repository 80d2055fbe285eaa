"""Request bodies for an OpenAI-compatible server, built from kvbench requests.

- ``token_ids``: the prompt's token ids as the completions API's ``prompt`` (vLLM and SGLang
  take a list of ids), so shared prefixes share exactly the ids the built-in engines cache;
  image and audio segments become their placeholder ids (KV-equivalent).
- ``text``: for servers that take only text, one word per token from a list of common
  English words that byte-pair vocabularies hold as single tokens (with their leading
  space), chosen by the token's id, so shared prefixes stay shared. The count is right for
  such vocabularies, not guaranteed for any tokenizer: the server's usage counts check it.
- With ``images``, a request with image segments goes to the chat completions API with each
  image as a synthetic PNG of the segment's size (a data URI), its text segments as text.

Generation is forced to the workload's length: ``max_tokens`` with ``ignore_eos`` (a vLLM and
SGLang extension), greedy for a single sample; ``return_token_ids`` (vLLM) lets the client
count streamed tokens exactly and digest the output.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from kvbench.workloads.model import Request, key_hash

PromptFormat = Literal["token_ids", "text"]
Api = Literal["completions", "chat"]

# Frequent English words that GPT-2, Llama and Qwen vocabularies store as one token each
# when preceded by a space.
WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "as", "with", "by", "that", "it",
    "at", "from", "his", "an", "were", "are", "which", "this", "be", "or", "has", "had", "not",
    "but", "first", "one", "their", "its", "new", "after", "who", "they", "have", "her", "two",
    "been", "other", "when", "there", "all", "during", "into", "school", "time", "may", "years",
    "more", "most", "only", "over", "city", "some", "world", "would", "where", "later", "up",
    "such", "used", "many", "can", "state", "about", "national", "out", "known", "university",
    "united", "then", "made",
)


@dataclass(frozen=True, slots=True)
class Payload:
    """One request's body (JSON bytes) and how its prompt was sent."""

    api: Api
    body: bytes
    prompt_format: PromptFormat
    images: int = 0  # image segments sent as PNG images
    placeholders: int = 0  # image/audio segments sent as placeholder ids or words


def synthetic_text(ids: np.ndarray) -> str:
    """One word per token id (no leading space: the server adds none before the first)."""
    words = np.asarray(WORDS)
    return " ".join(words[ids % len(words)].tolist())


def build_payload(
    request: Request,
    *,
    model: str,
    vocab_size: int,
    prompt_format: PromptFormat,
    images: bool,
    chat: bool = False,
) -> Payload:
    """The body of ``request``: completions with token ids or text, or chat with images
    when ``images`` and the request has image segments of a known size (always with
    ``chat``)."""
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "n": request.n,
        # vLLM refuses n > 1 with greedy sampling; a single sample is greedy, as in the
        # built-in engines.
        "temperature": 1.0 if request.n > 1 else 0.0,
    }
    multimodal = [s for s in request.segments if s.kind != "text"]
    drawable = [s for s in multimodal if s.kind == "image" and s.height and s.width
                and images]
    if drawable or chat:
        content = _chat_content(request, vocab_size, images)
        body = {**common, "messages": [{"role": "user", "content": content}]}
        return Payload("chat", _dumps(body), "text", len(drawable),
                       len(multimodal) - len(drawable))
    ids = request.prompt_token_ids(vocab_size)
    if prompt_format == "token_ids":
        body = {**common, "prompt": ids.tolist()}
    else:
        # The words are the prompt; a tokenizer's BOS would add a token.
        body = {**common, "prompt": synthetic_text(ids), "add_special_tokens": False}
    return Payload("completions", _dumps(body), prompt_format, 0, len(multimodal))


def _chat_content(request: Request, vocab_size: int, images: bool) -> list[dict[str, Any]]:
    """Chat content parts in segment order: text as synthetic words, images as PNGs, audio
    (and images without a size) as placeholder words."""
    ids = request.prompt_token_ids(vocab_size)
    parts: list[dict[str, Any]] = []
    start = 0
    for seg in request.segments:
        seg_ids = ids[start : start + seg.tokens]
        start += seg.tokens
        if images and seg.kind == "image" and seg.height and seg.width:
            url = "data:image/png;base64," + _png_b64(seg.key, seg.height, seg.width)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += " " + synthetic_text(seg_ids)
        else:
            parts.append({"type": "text", "text": synthetic_text(seg_ids)})
    return parts


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@lru_cache(maxsize=32)
def _png_b64(key: str, height: int, width: int) -> str:
    """A PNG of random pixels seeded by the segment's key: the same image content gives the
    same picture (so a server's multimodal cache can hit), different content differs."""
    return base64.b64encode(png_bytes(image_pixels(key, height, width))).decode()


def image_pixels(key: str, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(key_hash(key))
    return rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def png_bytes(rgb: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (height x width x 3, uint8)."""
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, -1)], axis=1)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(
            ">I", zlib.crc32(tag + data) & 0xFFFFFFFF
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    # Filter type 0 per row; level 1: random pixels do not compress anyway.
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + chunk(b"IEND", b""))

