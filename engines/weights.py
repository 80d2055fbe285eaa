"""Model weights: seeded random initialisation, or a local Hugging Face checkpoint.

A checkpoint directory holds ``config.json`` and ``*.safetensors`` (optionally sharded, with
``model.safetensors.index.json``). Tensors are read one at a time with ``safe_open``
straight onto the target device, so loading never holds a second copy of the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvbench.engines.llama import LlamaForCausalLM
from kvbench.engines.presets import DTYPE_BYTES, ModelPreset
from kvbench.engines.torch_device import ensure_fits
from kvbench.errors import KvbenchError
from kvbench.kernels.backend import KernelBackend
from kvbench.workloads.model import key_hash

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2"}
INDEX_FILE = "model.safetensors.index.json"
INIT_STD = 0.02

# Preset fields that must agree between a checkpoint and the preset the engine runs (the KV
# manager sized its budget from the preset).
_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "rope_theta", "rms_eps", "qkv_bias", "tie_embeddings",
)


class WeightsError(KvbenchError):
    """A checkpoint that cannot be loaded; the message names the file and, where known,
    the tensor."""


def hf_config(preset: ModelPreset) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``preset`` (the inverse of ``preset_from_hf_config``)."""
    config: dict[str, Any] = {
        "architectures": [preset.hf_architecture],
        "model_type": _MODEL_TYPES[preset.hf_architecture],
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position,
        "rope_theta": preset.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": preset.rms_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": preset.tie_embeddings,
        "torch_dtype": preset.dtype,
    }
    if preset.hf_architecture == "LlamaForCausalLM":
        config["attention_bias"] = preset.qkv_bias
        config["mlp_bias"] = False
    elif preset.hf_architecture == "MistralForCausalLM":
        config["sliding_window"] = None
    else:
        config["use_sliding_window"] = False
    return config


def preset_from_hf_config(config: dict[str, Any], name: str, source: str) -> ModelPreset:
    """Read a Hugging Face config into a preset; ``source`` names the file in errors."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise WeightsError(
            f"{source}: unsupported architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def unsupported(feature: str) -> WeightsError:
        return WeightsError(f"{source}: {feature} is not supported by the built-in model")

    if config.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act {config['hidden_act']!r}")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise unsupported(f"RoPE scaling {rope!r}")
    if arch == "LlamaForCausalLM" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise unsupported("attention_bias/mlp_bias (bias on o_proj and the MLP)")
    if arch == "MistralForCausalLM" and config.get("sliding_window") is not None:
        raise unsupported(f"sliding-window attention (sliding_window={config['sliding_window']})")
    if arch == "Qwen2ForCausalLM" and config.get("use_sliding_window"):
        raise unsupported("sliding-window attention (use_sliding_window=true)")
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise unsupported(f"dtype {dtype!r}")

    def need(key: str) -> Any:
        if key not in config:
            raise WeightsError(f"{source}: missing key {key!r}")
        return config[key]

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
    )


def read_checkpoint_preset(path: str | Path) -> ModelPreset:
    """The preset described by ``path/config.json`` (named after the directory)."""
    root = Path(path)
    config_path = root / "config.json"
    if not root.is_dir():
        raise WeightsError(f"{root}: weights directory not found")
    if not config_path.is_file():
        raise WeightsError(f"{config_path}: missing; a weights directory needs config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{config_path}: cannot read JSON ({exc})") from None
    return preset_from_hf_config(config, root.name, str(config_path))


def build_model(
    preset: ModelPreset,
    kernels: KernelBackend,
    device: torch.device,
    weights: str | Path | None = None,
    seed: int = 0,
) -> LlamaForCausalLM:
    """The decoder in ``preset.dtype`` on ``device``: loaded from ``weights`` or random from
    ``seed``. Parameters are allocated uninitialised on ``device`` and filled in place, one
    tensor at a time, so peak memory is the model plus one tensor."""
    if weights is not None:
        _check_matches(preset, read_checkpoint_preset(weights), Path(weights) / "config.json")
    ensure_fits(preset.num_params * preset.dtype_bytes, device, f"{preset.name} weights")
    with torch.device(device):
        model = LlamaForCausalLM(preset, kernels)
    with torch.no_grad():
        if weights is None:
            init_random_(model, seed, _decoder_std(preset.num_layers))
        else:
            _load_(model, Path(weights), device)
    return model


def init_random_(module: nn.Module, seed: int, std_of: Callable[[str], float | None]) -> None:
    """Fill every parameter in place: ones where ``std_of(name)`` is None (norm scales),
    else normal(0, std). Each tensor draws from its own generator seeded by (seed, name), so
    values do not depend on creation order and a model is the same on every run."""
    for name, param in module.named_parameters():
        std = std_of(name)
        if std is None:
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device)
        gen.manual_seed(key_hash(f"{seed}/{name}") & (2**63 - 1))
        # Drawn in float32 and rounded once, so lower-precision models are roundings of
        # the float32 one.
        param.copy_(
            torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32)
            * std
        )


def _decoder_std(num_layers: int) -> Callable[[str], float | None]:
    # Residual-branch outputs are scaled down (GPT-2 style) so the residual stream keeps unit
    # scale through depth and logits stay spread rather than dominated by a few tokens.
    residual = INIT_STD / math.sqrt(2 * num_layers)

    def std_of(name: str) -> float | None:
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return residual
        return INIT_STD

    return std_of


def _check_matches(preset: ModelPreset, ckpt: ModelPreset, source: Path) -> None:
    diffs = [
        f"{f}: preset {getattr(preset, f)!r}, checkpoint {getattr(ckpt, f)!r}"
        for f in _SHAPE_FIELDS
        if getattr(preset, f) != getattr(ckpt, f)
    ]
    if diffs:
        raise WeightsError(
            f"{source}: checkpoint does not match model preset {preset.name!r} ("
            + "; ".join(diffs)
            + "); build the preset from the checkpoint's config instead"
        )


def _tensor_files(root: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: cannot read weight_map ({exc})") from None
        files = {name: root / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise WeightsError(f"{file}: listed in {index} but missing")
        return files
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise WeightsError(
            f"{root}: no *.safetensors files (PyTorch .bin checkpoints are not supported)"
        )
    files = {}
    for file in shards:
        try:
            with safe_open(file, framework="pt") as f:
                files.update(dict.fromkeys(f.keys(), file))
        except (OSError, SafetensorError) as exc:
            raise WeightsError(f"{file}: not a readable safetensors file ({exc})") from None
    return files


def _load_(model: LlamaForCausalLM, root: Path, device: torch.device) -> None:
    files = _tensor_files(root)
    with ExitStack() as stack:
        handles: dict[Path, tuple[Any, set[str]]] = {}
        for name, param in model.named_parameters():
            file = files.get(name)
            if file is None:
                raise WeightsError(f"{root}: tensor {name!r} not found in any safetensors file")
            if file not in handles:
                try:
                    f = stack.enter_context(safe_open(file, framework="pt", device=str(device)))
                except (OSError, SafetensorError) as exc:
                    raise WeightsError(f"{file}: not a readable safetensors file ({exc})") from None
                handles[file] = (f, set(f.keys()))
            handle, names = handles[file]
            if name not in names:
                raise WeightsError(f"{file}: tensor {name!r} missing (the index lists it here)")
            shape = tuple(handle.get_slice(name).get_shape())
            if shape != tuple(param.shape):
                raise WeightsError(
                    f"{file}: tensor {name!r} has shape {list(shape)}, expected "
                    f"{list(param.shape)}"
                )
            param.copy_(handle.get_tensor(name))
