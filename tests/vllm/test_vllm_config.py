"""The config.json made from each model preset describes exactly the preset's shapes, as
transformers reads it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbench.engines.model.hf_config import SUPPORTED_ARCHITECTURES, hf_config, write_model_dir
from kvbench.engines.model.presets import ModelPreset, get_preset, preset_names
from kvbench.errors import KvbenchError


def _config(preset: ModelPreset, tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(write_model_dir(preset, tmp_path / preset.name))
    assert cfg.architectures == [preset.hf_architecture]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        preset.vocab_size, preset.hidden_size, preset.intermediate_size
    )
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        preset.num_layers, preset.num_heads, preset.num_kv_heads
    )
    assert cfg.max_position_embeddings == preset.max_position
    return cfg


@pytest.mark.parametrize("name", [n for n in preset_names()
                                  if get_preset(n).hf_architecture in SUPPORTED_ARCHITECTURES
                                  and not get_preset(n).kv_groups])
def test_transformers_reads_the_preset_shapes(name: str, tmp_path) -> None:
    preset = get_preset(name)
    cfg = _config(preset, tmp_path)
    assert cfg.head_dim == preset.head_dim
    assert getattr(cfg, "sliding_window", None) == preset.sliding_window
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    assert kv_per_token * preset.dtype_bytes == preset.kv_bytes_per_token


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_transformers_reads_latent_attention_and_experts(name: str, tmp_path) -> None:
    preset = get_preset(name)
    cfg = _config(preset, tmp_path)
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert cfg.num_hidden_layers * latent * preset.dtype_bytes == preset.kv_bytes_per_token
    assert preset.moe is not None
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.first_k_dense_replace) == (
        preset.moe.experts, preset.moe.active, preset.moe.dense_layers)


def test_transformers_reads_gemma2_layer_types(tmp_path) -> None:
    preset = get_preset("gemma-2-9b")
    cfg = _config(preset, tmp_path)
    sliding = cfg.layer_types.count("sliding_attention")
    assert [(g.kind, g.layers, g.window) for g in preset.layer_groups] == [
        ("sliding", sliding, cfg.sliding_window), ("full", cfg.num_hidden_layers - sliding, 0)]
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * preset.dtype_bytes
    assert per_layer * cfg.num_hidden_layers == preset.kv_bytes_per_token


def test_transformers_reads_qwen3_next_layer_types(tmp_path) -> None:
    preset = get_preset("qwen3-next-80b-a3b")
    cfg = _config(preset, tmp_path)
    full = cfg.layer_types.count("full_attention")
    assert cfg.layer_types.count("linear_attention") == cfg.num_hidden_layers - full
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * preset.dtype_bytes
    assert per_layer * full == preset.kv_bytes_per_token
    recurrent = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    conv = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    state = (recurrent + conv * (cfg.linear_conv_kernel_dim - 1)) * preset.dtype_bytes
    assert preset.kv_bytes_per_rank(0) == (cfg.num_hidden_layers - full) * state


def test_an_architecture_without_a_config_is_refused() -> None:
    odd = replace(get_preset("tiny"), hf_architecture="GPT2LMHeadModel")
    with pytest.raises(KvbenchError, match=r"supported: .*LlamaForCausalLM"):
        hf_config(odd)
