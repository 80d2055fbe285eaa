"""The config.json made from each model preset describes exactly the preset's shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbench.engines.model.hf_config import hf_config, write_model_dir
from kvbench.engines.model.presets import get_preset, preset_names
from kvbench.errors import KvbenchError


@pytest.mark.parametrize("name", preset_names())
def test_transformers_reads_the_preset_shapes(name: str, tmp_path) -> None:
    from transformers import AutoConfig

    preset = get_preset(name)
    cfg = AutoConfig.from_pretrained(write_model_dir(preset, tmp_path / name))
    assert cfg.architectures == [preset.hf_architecture]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        preset.vocab_size, preset.hidden_size, preset.intermediate_size
    )
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        preset.num_layers, preset.num_heads, preset.num_kv_heads
    )
    assert cfg.head_dim == preset.head_dim
    assert cfg.max_position_embeddings == preset.max_position
    assert getattr(cfg, "sliding_window", None) == preset.sliding_window
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    assert kv_per_token * preset.dtype_bytes == preset.kv_bytes_per_token


def test_an_architecture_without_a_config_is_refused() -> None:
    odd = replace(get_preset("tiny"), hf_architecture="GPT2LMHeadModel")
    with pytest.raises(KvbenchError, match="supported: LlamaForCausalLM"):
        hf_config(odd)
