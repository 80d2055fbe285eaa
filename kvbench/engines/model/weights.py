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

from kvbench.engines.builtin.torch_device import TORCH_DTYPES, ensure_fits
from kvbench.engines.model.hf_config import (
    KNOWN_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    WeightsError,
    preset_from_hf_config,
)
from kvbench.engines.model.llama import LlamaForCausalLM, packs
from kvbench.engines.model.presets import ModelPreset
from kvbench.kernels.backend import KernelBackend
from kvbench.workloads.model import key_hash

INDEX_FILE = "model.safetensors.index.json"
INIT_STD = 0.02

# Preset fields that must agree between a checkpoint and the preset the engine runs (the KV
# manager sized its budget from the preset).
_SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "rope_theta", "rms_eps", "qkv_bias", "tie_embeddings",
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
    archs = config.get("architectures") if isinstance(config, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch in KNOWN_ARCHITECTURES and arch not in SUPPORTED_ARCHITECTURES:
        raise WeightsError(
            f"{config_path}: the built-in model computes {', '.join(SUPPORTED_ARCHITECTURES)} "
            f"only; {arch} can be simulated (a sim device) or planned (kvbench capacity) "
            "from its preset"
        )
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
    # Packed copies for the CPU's matmul kernels take the weights' bytes again.
    copies = 2 if packs(device, TORCH_DTYPES[preset.dtype]) else 1
    ensure_fits(copies * preset.num_params * preset.dtype_bytes, device, f"{preset.name} weights")
    with torch.device(device):
        model = LlamaForCausalLM(preset, kernels)
    with torch.no_grad():
        if weights is None:
            init_random_(model, seed, _decoder_std(preset.num_layers))
        else:
            _load_(model, Path(weights), device)
        model.pack_weights()
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
