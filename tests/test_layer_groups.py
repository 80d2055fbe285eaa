"""KV per layer group: latent attention, interleaved sliding windows, recurrent state, MoE
parameter counts, and the published configs read into the presets."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from helpers import run_cli
from kvbench.engines.base import BatchShape
from kvbench.engines.kv.group_layout import group_layout
from kvbench.engines.kv.paged import PagedPolicy
from kvbench.engines.model.hf_config import hf_config, preset_from_hf_config
from kvbench.engines.model.layers import LayerGroup
from kvbench.engines.model.presets import ModelPreset, get_preset
from kvbench.engines.model.weights import read_checkpoint_preset
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import get_gpu
from kvbench.errors import KvbenchError
from kvbench.tools.capacity import Demand, Deployment, plan, plan_groups

# Published config.json fields (the Hugging Face model repositories).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000, "hidden_size": 3584,
    "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096,
    "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-06,
    "torch_dtype": "bfloat16", "query_pre_attn_scalar": 256,
}
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5120, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1,
    "max_position_embeddings": 262144, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


@pytest.mark.parametrize("name, config", [
    ("deepseek-v3", DEEPSEEK_V3), ("deepseek-v2-lite", DEEPSEEK_V2_LITE),
    ("gemma-2-9b", GEMMA_2_9B), ("qwen3-next-80b-a3b", QWEN3_NEXT),
])
def test_published_configs_read_into_the_presets(name, config):
    assert preset_from_hf_config(config, name, "config.json") == get_preset(name)


@pytest.mark.parametrize("name, total, active", [
    ("deepseek-v3", 671e9, 37e9), ("deepseek-v2-lite", 15.7e9, 2.4e9),
    ("gemma-2-9b", 9.24e9, 9.24e9), ("qwen3-next-80b-a3b", 80e9, 3e9),
])
def test_parameter_counts_match_the_published_sizes(name, total, active):
    p = get_preset(name)
    assert p.num_params == pytest.approx(total, rel=0.005)
    # Published active counts are rounded, some with the embeddings and some without.
    embeddings = p.vocab_size * p.hidden_size * (1 if p.tie_embeddings else 2)
    assert p.active_layer_params <= active * 1.1
    assert p.active_layer_params + embeddings >= active * 0.9


def test_kv_bytes_by_hand_from_the_configs():
    v3 = get_preset("deepseek-v3")
    # One 512 + 64 latent per token and layer, bfloat16, on every rank.
    assert v3.kv_bytes_per_token == 61 * 576 * 2 == 70272
    assert v3.kv_bytes_per_token_per_rank(8) == 70272
    gemma = get_preset("gemma-2-9b")
    per_layer = 2 * 8 * 256 * 2
    assert gemma.kv_bytes_per_token == 42 * per_layer
    # A 10,000-token sequence: 21 global layers keep it all, 21 sliding ones 4,096 tokens.
    assert gemma.kv_bytes_per_rank(10_000) == 21 * per_layer * 10_000 + 21 * per_layer * 4096
    assert gemma.kv_bytes_per_rank(100) == 42 * per_layer * 100
    nxt = get_preset("qwen3-next-80b-a3b")
    # Gated DeltaNet: a 128 x 128 matrix per value head, the convolution's last 3 inputs.
    state = (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 2
    assert nxt.kv_bytes_per_rank(0) == 36 * state == 39_518_208
    assert nxt.kv_bytes_per_rank(1000, tp=8) == 12 * 2 * 2 * 256 * 2 // 2 * 1000 + 36 * state // 8


def test_capacity_of_deepseek_v3_on_eight_h200_by_hand():
    dep = Deployment(get_preset("deepseek-v3"), get_gpu("h200"), 8192, tp=8)
    (row,) = plan(dep, [PagedPolicy(block_size=64)], [Demand(2048)])
    assert row.kv_bytes_per_token_per_rank == 70272
    pages = dep.kv_budget_bytes() // (64 * 70272 * 8)
    assert row.max_concurrent == pages * 64 // 2048
    # Llama-3-70B splits its 8 KV heads over the 8 ranks: 40 KiB a token on each.
    llama = Deployment(get_preset("llama-3-70b"), get_gpu("h200"), 8192, tp=8)
    (row70,) = plan(llama, [PagedPolicy(block_size=64)], [Demand(2048)])
    assert row70.kv_bytes_per_token_per_rank == 80 * 2 * 128 * 2
    assert row70.max_concurrent > row.max_concurrent


def test_weights_of_deepseek_v3_are_fp8_and_embeddings_bf16():
    p = get_preset("deepseek-v3")
    embeddings = 2 * p.vocab_size * p.hidden_size + p.hidden_size
    assert p.weight_bytes == embeddings * 2 + (p.num_params - embeddings)


def test_latent_attention_cost_by_hand():
    p, gpu = get_preset("deepseek-v3"), get_gpu("h200")
    terms = CostModel(p, gpu, tp=8).terms(BatchShape(
        num_seqs=4, decode_tokens=4, context_tokens=4000, attn_pairs=4000, decode_pairs=4000))
    # Absorbed decode: per head, 512 + 64 scores and 512 values; every rank reads the latent.
    assert terms.attention_flops == 61 * 2 * 128 * (2 * 512 + 64) * 4000 / 8
    assert terms.kv_bytes == (4000 + 4) * 70272
    # Prefill decompresses: per head, 128 + 64 query-key dims and 128 value dims.
    prefill = CostModel(p, gpu, tp=8).terms(BatchShape(
        num_seqs=1, prefill_tokens=100, context_tokens=100, attn_pairs=5050))
    assert prefill.attention_flops == 61 * 2 * 128 * (128 + 64 + 128) * 5050 / 8


def test_recurrent_state_is_read_and_written_each_step():
    p, gpu = get_preset("qwen3-next-80b-a3b"), get_gpu("h200")
    terms = CostModel(p, gpu).terms(BatchShape(
        num_seqs=3, decode_tokens=3, context_tokens=300, attn_pairs=300, decode_pairs=300))
    assert terms.kv_bytes == (300 + 3) * 12 * 2 * 2 * 256 * 2 + 3 * 2 * 39_518_208
    assert terms.attention_flops == 4 * 12 * 16 * 256 * 300


def test_layer_groups_must_add_up_and_hold_a_window():
    with pytest.raises(KvbenchError, match="do not add up"):
        replace(get_preset("gemma-2-9b"), num_layers=40)
    with pytest.raises(KvbenchError, match="window"):
        LayerGroup("sliding", 4, 2, 32)
    with pytest.raises(KvbenchError, match="at least one layer"):
        LayerGroup("full", 0, 2, 32)


@pytest.mark.parametrize("name", ["gemma-2-9b", "qwen3-next-80b-a3b"])
def test_mixed_groups_are_refused_by_the_engines(name):
    dep = Deployment(get_preset(name), get_gpu("h200"), 8192, tp=2)
    with pytest.raises(KvbenchError, match="hybrid KV policy"):
        plan(dep, [PagedPolicy(block_size=16)], [Demand(1024)])


def test_real_compute_refuses_a_deepseek_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(get_preset("deepseek-v2-lite"))))
    with pytest.raises(KvbenchError, match="can be simulated"):
        read_checkpoint_preset(tmp_path)


def test_bad_group_fields_in_a_config_are_clear_errors():
    with pytest.raises(KvbenchError, match="missing key 'kv_lora_rank'"):
        preset_from_hf_config({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"},
                              "x", "config.json")
    with pytest.raises(KvbenchError, match="at least one layer"):
        preset_from_hf_config(QWEN3_NEXT | {"full_attention_interval": 1}, "x", "config.json")


def _mixed(sliding: int, full: int, window: int = 64) -> ModelPreset:
    tiny = get_preset("tiny")
    return replace(tiny, name="mixed", num_layers=sliding + full, kv_groups=(
        LayerGroup("sliding", sliding, 2, 32, window=window), LayerGroup("full", full, 2, 32)))


def test_common_page_enlarges_attention_blocks_to_hold_a_state_page():
    layout = group_layout(get_preset("qwen3-next-80b-a3b"), "common-page", 16, tp=1)
    state, full = layout.groups
    # 16 x ceil(1,097,728 / (16 x 2,048)): the 544-token block vLLM logs for this model.
    assert full.page_tokens == 544 and layout.label == "common-page/bs544"
    assert state.page_bytes == full.page_bytes == 544 * 2048
    # One 3-group of 12 GDN layers per 12 attention layers: no padding layers.
    assert (state.tensors, full.tensors, layout.padding_tensors) == (36, 12, 0)
    at_tp8 = group_layout(get_preset("qwen3-next-80b-a3b"), "common-page", 16, tp=8)
    assert at_tp8.groups[1].page_tokens == 144
    per_group = group_layout(get_preset("qwen3-next-80b-a3b"), "per-group", 16, tp=1)
    assert per_group.request_bytes(1000) == 36 * 1_097_728 + 12 * 63 * 16 * 2048
    assert layout.request_bytes(1000) == 36 * 544 * 2048 + 12 * 2 * 544 * 2048


@pytest.mark.parametrize("sliding, full, size, padding", [
    (5, 2, 2, 1),  # groups of the fewest layers; the third sliding group is half empty
    (12, 13, 13, 1),  # fewer than 1.5x apart: groups of the most layers
    (21, 21, 21, 0),
])
def test_common_page_groups_layers_and_pads_as_vllm_does(sliding, full, size, padding):
    layout = group_layout(_mixed(sliding, full), "common-page", 16, tp=1)
    assert layout.padding_tensors == padding
    assert all(g.tensors % size == 0 for g in layout.groups)


def test_sliding_pages_cover_the_window_and_uniform_keeps_every_token():
    p = get_preset("gemma-2-9b")
    sliding, full = group_layout(p, "per-group", 16, tp=1).groups
    assert sliding.pages(100) == full.pages(100) == 7
    assert sliding.pages(10_000) == 4095 // 16 + 1 + 1 == 257  # vLLM: window / block + 1
    assert full.pages(10_000) == 625
    uniform = group_layout(p, "uniform", 16, tp=1)
    assert uniform.request_bytes(10_000) == 42 * 625 * 16 * 8192
    with pytest.raises(KvbenchError, match="recurrent state"):
        group_layout(get_preset("qwen3-next-80b-a3b"), "uniform", 16, tp=1)


def test_group_plan_by_hand():
    dep = Deployment(get_preset("gemma-2-9b"), get_gpu("h200"), 8192, tp=1)
    rows, notes = plan_groups(dep, [16], [Demand(8192)])
    by = {r.policy: r for r in rows}
    budget = dep.kv_budget_bytes()
    per_group = 21 * 512 * 16 * 8192 + 21 * 257 * 16 * 8192
    assert by["per-group/bs16"].request_bytes == per_group
    assert by["per-group/bs16"].max_concurrent == budget // per_group
    assert by["uniform/bs16"].max_concurrent == budget // (42 * 512 * 16 * 8192)
    needed = 21 * 8192 + 21 * 4096  # tokens x layers: global layers all, sliding the window
    assert by["uniform/bs16"].waste_fraction == pytest.approx(1 - needed / (42 * 8192))
    assert notes == []
    rows, notes = plan_groups(Deployment(get_preset("qwen3-next-80b-a3b"), get_gpu("h200"),
                                         8192, tp=8), [16], [Demand(2048)])
    assert [r.policy for r in rows] == ["common-page/bs144", "per-group/bs16"]
    assert "recurrent state" in notes[0]


def test_capacity_plans_layer_groups_and_refuses_what_it_cannot(capsys, tmp_path):
    code, out = run_cli(["capacity", "--model", "gemma-2-9b", "--gpu", "h200", "--seq-len",
                         "8192", "--block-size", "16"], capsys)
    assert code == 0, out
    assert "per-group/bs16" in out and "uniform/bs16" in out
    code, out = run_cli(["capacity", "--model", "gemma-2-9b", "--gpu", "h200", "--seq-len",
                         "8192", "--kv-offload", "cpu:64GiB"], capsys)
    assert code == 2 and "drop them" in out
    code, out = run_cli(["run", "--model", "gemma-2-9b", "--device", "sim:h200", "--engines",
                         "paged", "--out", str(tmp_path / "run"), "--force"], capsys)
    assert code == 2 and "hybrid KV policy" in out


def test_capacity_reads_a_config_json(capsys, tmp_path):
    folder = tmp_path / "DeepSeek-V3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    code, out = run_cli(["capacity", "--model", str(folder), "--gpu", "h200", "--tp", "8",
                         "--seq-len", "2048", "--block-size", "64"], capsys)
    assert code == 0, out
    assert "DeepSeek-V3 on 8x h200" in out and "68.6 KiB/token/rank" in out
    code, out = run_cli(["capacity", "--model", str(folder / "config.json"), "--gpu", "h200",
                         "--seq-len", "2048", "--grid", "tp=4,8", "--block-size", "64"], capsys)
    assert code == 0, out


@pytest.mark.parametrize("content, match", [
    ("[1, 2]", "top level is not a JSON object"),
    ("{not json", "not JSON"),
    (json.dumps(DEEPSEEK_V3 | {"hidden_size": "7168"}), "hidden_size must be a whole number"),
    (json.dumps(DEEPSEEK_V3 | {"kv_lora_rank": [512]}), "wrong type"),
    (json.dumps(DEEPSEEK_V3 | {"architectures": {"a": 1}}), "wrong type"),
    (json.dumps(GEMMA_2_9B | {"num_key_value_heads": 0}), "at least 1"),
    (json.dumps(QWEN3_NEXT | {"rope_theta": "fast"}), "wrong type"),
    (json.dumps(DEEPSEEK_V3 | {"num_hidden_layers": True}), "wrong type|whole number"),
])
def test_a_hostile_config_json_is_a_clear_error(capsys, tmp_path, content, match):
    path = tmp_path / "config.json"
    path.write_text(content)
    code, out = run_cli(["capacity", "--model", str(path), "--gpu", "h200", "--seq-len",
                         "2048"], capsys)
    assert code == 2, out
    assert re.search(match, out), out
    assert "Traceback" not in out
