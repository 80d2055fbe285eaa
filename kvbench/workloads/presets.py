"""Named workloads, sized so the CPU ``tiny`` model (4096 positions) runs all of them.

Every request's prompt plus output stays within 2048 tokens (``long-context``: 4096); the
bounds come from each class's ``max`` clips, and the tests check them.
"""

from __future__ import annotations

from typing import Any

from kvbench.errors import KvbenchError
from kvbench.units import did_you_mean
from kvbench.workloads.generator import generate
from kvbench.workloads.model import Workload
from kvbench.workloads.spec import WorkloadSpec


def _uniform(low: int, high: int) -> dict[str, Any]:
    return {"kind": "uniform", "low": low, "high": high}


def _lognormal(median: int, sigma: float, lo: int, hi: int) -> dict[str, Any]:
    return {"kind": "lognormal", "median": median, "sigma": sigma, "min": lo, "max": hi}


_PRESETS: dict[str, dict[str, Any]] = {
    # Chat, summarisation and code requests under Poisson load.
    "mixed-text": {
        "arrival": {"kind": "poisson", "rate": 4.0},
        "num_requests": 100,
        "classes": [
            {"name": "chat", "weight": 0.6,
             "prompt": _lognormal(200, 0.9, 8, 1024), "output": _lognormal(150, 0.8, 8, 512)},
            {"name": "summarize", "weight": 0.25,
             "prompt": _uniform(512, 1536), "output": _uniform(32, 256)},
            {"name": "code", "weight": 0.15,
             "prompt": {"kind": "zipf", "a": 1.1, "min": 16, "max": 1024},
             "output": {"kind": "normal", "mean": 300, "std": 100, "min": 64, "max": 768}},
        ],
    },
    # Text, single-image ViT, LLaVA-1.5 and Qwen2-VL image questions, and audio clips.
    "mixed-multimodal": {
        "arrival": {"kind": "poisson", "rate": 2.0},
        "num_requests": 100,
        "classes": [
            {"name": "text", "weight": 0.3,
             "prompt": _lognormal(256, 0.8, 16, 1024), "output": _lognormal(128, 0.7, 16, 512)},
            {"name": "vit", "weight": 0.2,
             "images": {"count": {"kind": "fixed", "value": 1}, "sizes": [[224, 224]],
                        "rule": "vit-l14"},
             "prompt": _uniform(16, 256), "output": _uniform(32, 256)},
            {"name": "llava", "weight": 0.2,
             "images": {"count": _uniform(1, 2), "sizes": [[336, 336], [448, 448], [480, 640]],
                        "rule": "llava-1.5"},
             "prompt": _uniform(16, 256), "output": _uniform(32, 256)},
            {"name": "qwen2-vl", "weight": 0.2,
             "images": {"count": _uniform(1, 2),
                        "sizes": [[224, 224], [336, 336], [448, 448], [448, 672]],
                        "rule": "qwen2-vl"},
             "prompt": _uniform(16, 256), "output": _uniform(32, 256)},
            {"name": "speech", "weight": 0.1,
             "audio": {"seconds": _uniform(2, 20)},
             "prompt": _uniform(8, 128), "output": _uniform(16, 256)},
        ],
    },
    # Assistants behind a few system prompts / few-shot templates, bursty arrivals.
    "shared-prefix": {
        "arrival": {"kind": "gamma", "rate": 4.0, "burstiness": 0.5},
        "num_requests": 100,
        "classes": [
            {"name": "assistant", "weight": 0.7,
             "prefix": {"templates": 4, "tokens": _uniform(256, 1024)},
             "prompt": _lognormal(96, 0.7, 8, 512), "output": _lognormal(96, 0.7, 8, 512)},
            {"name": "few-shot", "weight": 0.3,
             "prefix": {"templates": 2, "tokens": {"kind": "fixed", "value": 1536}},
             "prompt": _uniform(8, 128), "output": _uniform(8, 128)},
        ],
    },
    # Chat sessions of 2–5 turns; each turn resends the whole conversation so far.
    "multi-turn": {
        "arrival": {"kind": "poisson", "rate": 1.0},
        "num_requests": 100,
        "classes": [
            {"name": "chat",
             "prefix": {"templates": 1, "tokens": {"kind": "fixed", "value": 64}},
             "session": {"turns": _uniform(2, 5), "think_time_s": 10.0},
             "prompt": _lognormal(64, 0.6, 8, 192), "output": _lognormal(96, 0.6, 8, 192)},
        ],
    },
    # Image reuse: chats about one image (the same image after the same system prompt in
    # every turn) and questions over a catalogue of 16 product photos shared by all.
    "multimodal-reuse": {
        "arrival": {"kind": "poisson", "rate": 2.0},
        "num_requests": 100,
        "classes": [
            {"name": "image-chat", "weight": 0.4,
             "prefix": {"templates": 1, "tokens": {"kind": "fixed", "value": 128}},
             "images": {"count": {"kind": "fixed", "value": 1},
                        "sizes": [[448, 448], [336, 448], [448, 336]], "rule": "qwen2-vl"},
             "session": {"turns": _uniform(2, 5), "think_time_s": 8.0},
             "prompt": _lognormal(48, 0.6, 8, 128), "output": _lognormal(96, 0.6, 16, 192)},
            {"name": "catalogue", "weight": 0.6,
             "prefix": {"templates": 1, "tokens": {"kind": "fixed", "value": 256}},
             "images": {"count": {"kind": "fixed", "value": 1}, "pool": 16,
                        "sizes": [[448, 448], [448, 672], [672, 448]], "rule": "qwen2-vl"},
             "prompt": _uniform(8, 64), "output": _uniform(16, 160)},
        ],
    },
    # Document-length prompts filling most of a 4096-position model.
    "long-context": {
        "arrival": {"kind": "poisson", "rate": 0.5},
        "num_requests": 32,
        "classes": [
            {"name": "document",
             "prompt": _uniform(2048, 3584),
             "output": {"kind": "empirical", "values": [64, 128, 256, 512],
                        "weights": [0.4, 0.3, 0.2, 0.1]}},
        ],
    },
    # Best-of-n sampling: each request forks n sequences over one prompt.
    "parallel-sampling": {
        "arrival": {"kind": "poisson", "rate": 2.0},
        "num_requests": 64,
        "classes": [
            {"name": "best-of-4", "weight": 0.5, "n": 4,
             "prompt": _uniform(128, 768), "output": _uniform(64, 512)},
            {"name": "pair", "weight": 0.5, "n": 2,
             "prompt": _uniform(128, 768), "output": _uniform(64, 512)},
        ],
    },
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def get_preset_spec(name: str) -> WorkloadSpec:
    if name not in _PRESETS:
        raise KvbenchError(
            f"unknown workload preset {name!r}; {did_you_mean(name, _PRESETS)}valid: "
            f"{', '.join(_PRESETS)}"
        )
    return WorkloadSpec.model_validate(_PRESETS[name])


def generate_preset(name: str, num_requests: int | None = None, seed: int = 0) -> Workload:
    return generate(
        get_preset_spec(name), num_requests, seed, name=name, source=f"preset {name}"
    )
