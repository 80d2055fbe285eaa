"""Hugging Face ``config.json`` files and model presets, both ways: the config of a preset
(so vLLM builds exactly the preset's shapes with dummy weights, and tests write checkpoints),
and the preset of a checkpoint's config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench.engines.model.hf_hybrid import READERS, WRITERS
from kvbench.engines.model.presets import DTYPE_BYTES, ModelPreset
from kvbench.errors import KvbenchError

# The architectures these fields describe completely; all three are Llama-style decoders,
# the ones the built-in model computes.
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES)
# Those presets and configs describe too, for simulation and capacity planning.
KNOWN_ARCHITECTURES = SUPPORTED_ARCHITECTURES + tuple(READERS)


class WeightsError(KvbenchError):
    """A checkpoint that cannot be loaded; the message names the file and, where known,
    the tensor."""


def hf_config(preset: ModelPreset) -> dict[str, Any]:
    """The ``config.json`` content describing ``preset`` (the inverse of
    :func:`preset_from_hf_config`)."""
    arch = preset.hf_architecture
    if arch in WRITERS:
        return WRITERS[arch](preset)
    model_type = _MODEL_TYPES.get(arch)
    if model_type is None:
        raise KvbenchError(
            f"model preset {preset.name!r} has architecture {arch!r}, which a config.json "
            f"cannot describe here; supported: {', '.join(sorted(KNOWN_ARCHITECTURES))}"
        )
    if model_type == "qwen2" and not preset.qkv_bias:
        raise KvbenchError(
            f"model preset {preset.name!r}: Qwen2 always has QKV biases, but the preset has none"
        )
    if model_type == "llama" and preset.sliding_window is not None:
        raise KvbenchError(
            f"model preset {preset.name!r}: a Llama config.json has no sliding window; use "
            "the Mistral or Qwen2 architecture for sliding-window attention"
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
        "rope_scaling": None,
        "rms_norm_eps": preset.rms_eps,
        "hidden_act": "silu",
        "torch_dtype": preset.dtype,
        "tie_word_embeddings": preset.tie_embeddings,
    }
    if model_type == "llama":
        cfg["attention_bias"] = preset.qkv_bias
        cfg["mlp_bias"] = False
    else:
        # The window of every layer, or None: full attention.
        cfg["sliding_window"] = preset.sliding_window
        if model_type == "qwen2":
            windowed = preset.sliding_window is not None
            cfg["use_sliding_window"] = windowed
            if windowed:  # Qwen2 windows the layers from max_window_layers on: all of them
                cfg["max_window_layers"] = 0
    return cfg


def preset_from_hf_config(config: dict[str, Any], name: str, source: str) -> ModelPreset:
    """Read a Hugging Face config into a preset; ``source`` names the file in errors."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in KNOWN_ARCHITECTURES:
        raise WeightsError(
            f"{source}: unsupported architecture {arch!r}; supported: "
            f"{', '.join(KNOWN_ARCHITECTURES)}"
        )
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise WeightsError(f"{source}: dtype {dtype!r} is not supported; use one of "
                           f"{', '.join(DTYPE_BYTES)}")

    def need(key: str) -> Any:
        if key not in config:
            raise WeightsError(f"{source}: missing key {key!r}")
        return config[key]

    if arch in READERS:
        return READERS[arch](config, name, need)

    def unsupported(feature: str) -> WeightsError:
        return WeightsError(f"{source}: {feature} is not supported by the built-in model")

    if config.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act {config['hidden_act']!r}")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise unsupported(f"RoPE scaling {rope!r}")
    if arch == "LlamaForCausalLM" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise unsupported("attention_bias/mlp_bias (bias on o_proj and the MLP)")
    window = None
    if arch == "MistralForCausalLM":
        window = config.get("sliding_window")
    elif arch == "Qwen2ForCausalLM" and config.get("use_sliding_window"):
        if config.get("max_window_layers", 0) not in (0, None):
            raise unsupported(
                f"sliding windows in only some layers (max_window_layers="
                f"{config['max_window_layers']})"
            )
        window = config.get("sliding_window")
    num_heads = need("num_attention_heads")
    return ModelPreset(
        name=name,
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or need("hidden_size") // num_heads,
        intermediate_size=need("intermediate_size"),
        max_position=need("max_position_embeddings"),
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        dtype=dtype,
        qkv_bias=arch == "Qwen2ForCausalLM",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        hf_architecture=arch,
        sliding_window=window,
    )


def write_model_dir(preset: ModelPreset, path: Path) -> Path:
    """Write ``config.json`` for ``preset`` into ``path`` (created) and return ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(preset), indent=2), encoding="utf-8")
    return path
