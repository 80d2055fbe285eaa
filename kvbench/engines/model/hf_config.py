"""Hugging Face ``config.json`` files and model presets, both ways: the config of a preset
(so vLLM builds exactly the preset's shapes with dummy weights, and tests write checkpoints),
and the preset of a checkpoint's config."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvbench.engines.model.hf_hybrid import READERS, WRITERS, base_config
from kvbench.engines.model.presets import DTYPE_BYTES, ModelPreset, get_preset, preset_names
from kvbench.errors import InputFileError, KvbenchError
from kvbench.fileio import read_text

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
    if model_type is not None and preset.kv_groups:
        raise KvbenchError(
            f"model preset {preset.name!r} keeps "
            f"{' + '.join(g.describe() for g in preset.kv_groups)} KV in a {arch} model, "
            "which no config.json describes; it runs on the built-in engines only")
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
    cfg = base_config(preset, model_type) | {
        "head_dim": preset.head_dim, "rope_scaling": None, "hidden_act": "silu",
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
    """Read a Hugging Face config into a preset; ``source`` names the file in errors. The
    config is untrusted: a value of the wrong type or a count below one is a clear error."""
    if not isinstance(config, dict):
        raise WeightsError(f"{source}: not a config.json: its top level is not a JSON object")
    try:
        preset = _read_preset(config, name, source)
    except (TypeError, ValueError, AttributeError, IndexError, KeyError) as exc:
        raise WeightsError(f"{source}: a field holds a value of the wrong type ({exc}); check "
                           "the file against the model's published config.json") from None
    _check_counts(preset, source)
    return preset


def _check_counts(preset: ModelPreset, source: str) -> None:
    """Every count of ``preset`` and of the shapes it holds is a whole number, at least one
    where the model needs one."""
    parts = [preset, preset.latent, preset.linear, preset.moe, *preset.kv_groups]
    for part in filter(None, parts):
        for f in fields(part):
            value = getattr(part, f.name)
            if f.type not in ("int", "int | None") or value is None:
                continue
            least = 1 if part is preset else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise WeightsError(f"{source}: {f.name} must be a whole number of at least "
                                   f"{least}, not {value!r}")


def model_preset(text: str) -> ModelPreset:
    """A preset by name, or the one a Hugging Face ``config.json`` describes (the file, or a
    folder holding one), named after its folder."""
    path = Path(text)
    if text in preset_names() or not (text.endswith(".json") or path.is_dir()):
        return get_preset(text)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(read_text(file, "config.json"))
    except json.JSONDecodeError as exc:
        raise InputFileError(file, f"not JSON ({exc})") from None
    name = file.resolve().parent.name if file.name == "config.json" else file.stem
    return preset_from_hf_config(config, name or "model", str(file))


def _read_preset(config: dict[str, Any], name: str, source: str) -> ModelPreset:
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
