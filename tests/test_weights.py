"""Random initialisation and Hugging Face checkpoint loading, including every error."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from model_driver import SMALL, Runner, prompts
from safetensors.torch import save_file

from kvbench.engines.builtin import torch_device
from kvbench.engines.model.hf_config import WeightsError, hf_config, preset_from_hf_config
from kvbench.engines.model.llama import LlamaForCausalLM
from kvbench.engines.model.presets import get_preset, preset_names
from kvbench.engines.model.weights import INDEX_FILE, build_model, read_checkpoint_preset
from kvbench.errors import KvbenchError
from kvbench.kernels.backend import get_backend

QWEN = replace(SMALL, qkv_bias=True, tie_embeddings=True, hf_architecture="Qwen2ForCausalLM")
KERNELS = get_backend("reference")
CPU = torch.device("cpu")


def save_checkpoint(model: LlamaForCausalLM, path: Path, shards: int = 1, config=None) -> Path:
    """Write ``model`` the way Hugging Face does: config.json plus (sharded) safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or hf_config(model.preset)))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def logits(model: LlamaForCausalLM):
    (ids,) = prompts([23])
    return Runner(model, "paged", 1).step([(0, ids, 0)])


@pytest.mark.parametrize("preset", [SMALL, QWEN], ids=["llama", "qwen2"])
@pytest.mark.parametrize("shards", [1, 3])
def test_round_trip_gives_identical_logits(tmp_path, preset, shards):
    model = build_model(preset, KERNELS, CPU, seed=7)
    ckpt = save_checkpoint(model, tmp_path / "ckpt", shards)
    loaded = build_model(preset, KERNELS, CPU, weights=str(ckpt))
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name
    assert torch.equal(logits(model), logits(loaded))


def test_load_converts_dtype(tmp_path):
    ckpt = save_checkpoint(build_model(SMALL, KERNELS, CPU, seed=7), tmp_path / "ckpt")
    loaded = build_model(SMALL.with_dtype("bfloat16"), KERNELS, CPU, weights=str(ckpt))
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())


def test_random_init_is_deterministic():
    a, b = build_model(SMALL, KERNELS, CPU, seed=1), build_model(SMALL, KERNELS, CPU, seed=1)
    c = build_model(SMALL, KERNELS, CPU, seed=2)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    # Residual outputs are scaled down; norms start at one.
    layer = a.model.layers[0]
    assert layer.mlp.down_proj.weight.std() < layer.mlp.up_proj.weight.std() / 1.5
    assert torch.equal(layer.input_layernorm.weight, torch.ones(SMALL.hidden_size))


@pytest.mark.parametrize("name", preset_names())
def test_preset_config_round_trip(name):
    preset = get_preset(name)
    if name in ("tiny-swa", "tiny-mla"):  # no Llama config.json has their layer groups
        with pytest.raises(KvbenchError, match="built-in engines only"):
            hf_config(preset)
        return
    assert preset_from_hf_config(hf_config(preset), preset.name, "config.json") == preset


def test_checkpoint_preset_is_read_from_config(tmp_path):
    ckpt = save_checkpoint(build_model(QWEN, KERNELS, CPU), tmp_path / "my-model")
    assert read_checkpoint_preset(ckpt) == replace(QWEN, name="my-model")


def expect(match: str, path, preset=SMALL) -> WeightsError:
    with pytest.raises(WeightsError, match=match) as info:
        build_model(preset, KERNELS, CPU, weights=str(path))
    assert isinstance(info.value, KvbenchError)
    return info.value


def test_missing_directory_and_config(tmp_path):
    expect("weights directory not found", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    expect(r"config.json: missing", tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    expect("cannot read JSON", tmp_path / "bad")


def test_unsupported_architecture_lists_supported(tmp_path):
    config = hf_config(SMALL) | {"architectures": ["GPT2LMHeadModel"]}
    ckpt = save_checkpoint(build_model(SMALL, KERNELS, CPU), tmp_path / "c", config=config)
    err = expect("unsupported architecture 'GPT2LMHeadModel'", ckpt)
    assert "LlamaForCausalLM" in str(err) and "Qwen2ForCausalLM" in str(err)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_features(tmp_path, change, match):
    config = hf_config(SMALL) | change
    ckpt = save_checkpoint(build_model(SMALL, KERNELS, CPU), tmp_path / "c", config=config)
    expect(match, ckpt)


def test_preset_mismatch_lists_fields(tmp_path):
    ckpt = save_checkpoint(build_model(SMALL, KERNELS, CPU), tmp_path / "c")
    err = expect("does not match model preset", ckpt, preset=replace(SMALL, num_layers=3))
    assert "num_layers: preset 3, checkpoint 2" in str(err)


def test_no_safetensors_files(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(hf_config(SMALL)))
    expect(r"no \*.safetensors files", tmp_path / "c")


def test_missing_tensor_names_it(tmp_path):
    ckpt = save_checkpoint(build_model(SMALL, KERNELS, CPU), tmp_path / "c")
    tensors = {k: v.contiguous() for k, v in build_model(SMALL, KERNELS, CPU).state_dict().items()}
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    expect(r"tensor 'model.layers.1.mlp.up_proj.weight' not found", ckpt)


def test_mismatched_shape_names_file_and_tensor(tmp_path):
    ckpt = save_checkpoint(build_model(SMALL, KERNELS, CPU), tmp_path / "c")
    tensors = {k: v.contiguous() for k, v in build_model(SMALL, KERNELS, CPU).state_dict().items()}
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, SMALL.hidden_size)
    save_file(tensors, ckpt / "model.safetensors")
    err = expect(
        r"'model.layers.0.self_attn.k_proj.weight' has shape \[16, 64\], expected \[32, 64\]",
        ckpt,
    )
    assert "model.safetensors" in str(err)


def test_index_listing_missing_shard(tmp_path):
    ckpt = save_checkpoint(build_model(SMALL, KERNELS, CPU), tmp_path / "c", shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    expect(r"model-00002-of-00002.safetensors: listed in .*index.json but missing", ckpt)


def test_corrupt_safetensors_file(tmp_path):
    ckpt = save_checkpoint(build_model(SMALL, KERNELS, CPU), tmp_path / "c")
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 16)
    expect("not a readable safetensors file", ckpt)


def test_weights_larger_than_free_memory(monkeypatch):
    monkeypatch.setattr(torch_device, "free_bytes", lambda device: 1000)
    with pytest.raises(KvbenchError, match=r"cannot allocate small weights: .* asked, .*\(1000"):
        build_model(SMALL, KERNELS, CPU)


def test_sliding_windows_read_from_mistral_and_qwen2_configs(tmp_path):
    v01 = get_preset("mistral-7b-v0.1")
    assert (v01.vocab_size, v01.rope_theta, v01.sliding_window) == (32000, 10000.0, 4096)
    assert hf_config(v01)["sliding_window"] == 4096
    qwen = replace(QWEN, sliding_window=64)
    cfg = hf_config(qwen)
    assert (cfg["use_sliding_window"], cfg["max_window_layers"]) == (True, 0)
    assert preset_from_hf_config(cfg, qwen.name, "config.json") == qwen
    partly = cfg | {"max_window_layers": 1}  # full attention in the first layer only
    with pytest.raises(WeightsError, match="only some layers"):
        preset_from_hf_config(partly, qwen.name, "config.json")
    with pytest.raises(KvbenchError, match="no sliding window"):
        hf_config(replace(SMALL, sliding_window=64))  # a Llama config cannot say it
