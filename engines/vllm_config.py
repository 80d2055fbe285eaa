"""A Hugging Face ``config.json`` made from a model preset, so vLLM builds exactly the preset's
shapes (with dummy weights) without downloading anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench.engines.presets import ModelPreset
from kvbench.errors import KvbenchError

# The architectures vLLM builds from these fields alone; all three are Llama-style decoders.
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def hf_config(preset: ModelPreset) -> dict[str, Any]:
    """The ``config.json`` content describing ``preset``."""
    arch = preset.hf_architecture
    model_type = _MODEL_TYPES.get(arch)
    if model_type is None:
        raise KvbenchError(
            f"model preset {preset.name!r} has architecture {arch!r}, which the vLLM adapter "
            f"cannot describe; supported: {', '.join(sorted(_MODEL_TYPES))}"
        )
    if model_type == "qwen2" and not preset.qkv_bias:
        raise KvbenchError(
            f"model preset {preset.name!r}: Qwen2 always has QKV biases, but the preset has none"
        )
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "max_position_embeddings": preset.max_position,
        "rope_theta": preset.rope_theta,
        "rms_norm_eps": preset.rms_eps,
        "hidden_act": "silu",
        "torch_dtype": preset.dtype,
        "tie_word_embeddings": preset.tie_embeddings,
    }
    if model_type == "llama":
        cfg["attention_bias"] = preset.qkv_bias
        cfg["mlp_bias"] = False
    else:
        # Full attention in every layer, as the presets (and the KV budget) assume.
        cfg["sliding_window"] = None
        if model_type == "qwen2":
            cfg["use_sliding_window"] = False
    return cfg


def write_model_dir(preset: ModelPreset, path: Path) -> Path:
    """Write ``config.json`` for ``preset`` into ``path`` (created) and return ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(preset), indent=2), encoding="utf-8")
    return path
