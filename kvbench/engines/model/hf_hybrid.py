"""``config.json`` fields of the heterogeneous-KV architectures, both ways: DeepSeek-V2/V3
(latent attention, MoE), Gemma-2 (alternating sliding-window and global layers) and
Qwen3-Next (Gated DeltaNet and gated attention, MoE). These are simulated only: the built-in
model computes Llama-style decoders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbench.engines.model.layers import LayerGroup
from kvbench.engines.model.presets import (
    DTYPE_BYTES,
    GatedDeltaNet,
    LatentAttention,
    MixtureOfExperts,
    ModelPreset,
)
from kvbench.errors import KvbenchError

_FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128]}


def base_config(p: ModelPreset, model_type: str) -> dict[str, Any]:
    """The ``config.json`` fields every architecture shares."""
    return {
        "architectures": [p.hf_architecture], "model_type": model_type,
        "vocab_size": p.vocab_size, "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size, "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads, "num_key_value_heads": p.num_kv_heads,
        "max_position_embeddings": p.max_position, "rope_theta": p.rope_theta,
        "rms_norm_eps": p.rms_eps, "torch_dtype": p.dtype,
        "tie_word_embeddings": p.tie_embeddings,
    }


def _deepseek_config(p: ModelPreset, model_type: str) -> dict[str, Any]:
    lat, moe = p.latent, p.moe
    if lat is None or moe is None or moe.shared_intermediate % moe.intermediate_size:
        raise KvbenchError(f"model preset {p.name!r}: a DeepSeek config needs latent attention "
                           "and MoE with whole shared experts")
    cfg = base_config(p, model_type) | {
        "q_lora_rank": lat.q_lora_rank, "kv_lora_rank": lat.kv_lora_rank,
        "qk_nope_head_dim": lat.qk_nope_dim, "qk_rope_head_dim": lat.qk_rope_dim,
        "v_head_dim": lat.v_head_dim, "moe_intermediate_size": moe.intermediate_size,
        "n_routed_experts": moe.experts, "num_experts_per_tok": moe.active,
        "n_shared_experts": moe.shared_intermediate // moe.intermediate_size,
        "first_k_dense_replace": moe.dense_layers, "moe_layer_freq": 1, "hidden_act": "silu",
    }
    if p.weight_dtype == "float8":
        cfg["quantization_config"] = dict(_FP8_BLOCKS)
    return cfg


def _deepseek_preset(c: dict[str, Any], name: str, need: Callable[[str], Any]) -> ModelPreset:
    layers, moe_inter = need("num_hidden_layers"), need("moe_intermediate_size")
    lat = LatentAttention(c.get("q_lora_rank"), need("kv_lora_rank"), need("qk_nope_head_dim"),
                          need("qk_rope_head_dim"), need("v_head_dim"))
    quant = (c.get("quantization_config") or {}).get("quant_method")
    if c.get("moe_layer_freq", 1) != 1:
        raise KvbenchError(f"moe_layer_freq {c['moe_layer_freq']} is not modelled; only 1")
    return ModelPreset(
        **_common_fields(c, name, need), head_dim=lat.qk_nope_dim + lat.qk_rope_dim,
        kv_groups=(LayerGroup("latent", layers, latent_dim=lat.kv_lora_rank,
                              rope_dim=lat.qk_rope_dim),),
        latent=lat,
        moe=MixtureOfExperts(need("n_routed_experts"), need("num_experts_per_tok"), moe_inter,
                             (c.get("n_shared_experts") or 0) * moe_inter,
                             c.get("first_k_dense_replace") or 0),
        weight_dtype="float8" if quant == "fp8" else None,
    )


def _gemma2_config(p: ModelPreset) -> dict[str, Any]:
    sliding = [g for g in p.layer_groups if g.kind == "sliding"]
    if len(sliding) != 1 or sliding[0].layers != (p.num_layers + 1) // 2:
        raise KvbenchError(f"model preset {p.name!r}: Gemma-2 alternates sliding-window and "
                           "global layers, sliding first")
    return base_config(p, "gemma2") | {
        "head_dim": p.head_dim, "sliding_window": sliding[0].window,
        "query_pre_attn_scalar": p.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": [("sliding_attention", "full_attention")[i % 2]
                        for i in range(p.num_layers)],
    }


def _gemma2_preset(c: dict[str, Any], name: str, need: Callable[[str], Any]) -> ModelPreset:
    layers = need("num_hidden_layers")
    types = c.get("layer_types") or [("sliding_attention", "full_attention")[i % 2]
                                     for i in range(layers)]
    sliding = sum(t == "sliding_attention" for t in types)
    kv_heads, head_dim = need("num_key_value_heads"), need("head_dim")
    groups = []
    if sliding:
        groups.append(LayerGroup("sliding", sliding, kv_heads, head_dim,
                                 window=need("sliding_window")))
    if layers > sliding:
        groups.append(LayerGroup("full", layers - sliding, kv_heads, head_dim))
    return ModelPreset(**_common_fields(c, name, need) | {"tie_embeddings": True},
                       head_dim=head_dim, kv_groups=tuple(groups))


def _qwen3_next_config(p: ModelPreset) -> dict[str, Any]:
    lin, moe = p.linear, p.moe
    if lin is None or moe is None:
        raise KvbenchError(f"model preset {p.name!r}: a Qwen3-Next config needs Gated DeltaNet "
                           "layers and MoE")
    return base_config(p, "qwen3_next") | {
        "head_dim": p.head_dim, "full_attention_interval": lin.full_attention_interval,
        "linear_num_key_heads": lin.k_heads, "linear_num_value_heads": lin.v_heads,
        "linear_key_head_dim": lin.k_dim, "linear_value_head_dim": lin.v_dim,
        "linear_conv_kernel_dim": lin.conv_kernel, "num_experts": moe.experts,
        "num_experts_per_tok": moe.active, "moe_intermediate_size": moe.intermediate_size,
        "shared_expert_intermediate_size": moe.shared_intermediate, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "partial_rotary_factor": 0.25,
        "hidden_act": "silu",
    }


def _qwen3_next_preset(c: dict[str, Any], name: str, need: Callable[[str], Any]) -> ModelPreset:
    layers, kv_heads, head_dim = (need("num_hidden_layers"), need("num_key_value_heads"),
                                  need("head_dim"))
    if c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"):
        raise KvbenchError("dense MLP layers in Qwen3-Next (decoder_sparse_step, "
                           "mlp_only_layers) are not modelled")
    lin = GatedDeltaNet(need("full_attention_interval"), need("linear_num_key_heads"),
                        need("linear_num_value_heads"), need("linear_key_head_dim"),
                        need("linear_value_head_dim"), need("linear_conv_kernel_dim"))
    full = layers // lin.full_attention_interval
    fields = _common_fields(c, name, need)
    state = lin.state_bytes(DTYPE_BYTES[fields["dtype"]])
    return ModelPreset(
        **fields, head_dim=head_dim,
        kv_groups=(LayerGroup("state", layers - full, state_bytes=state),
                   LayerGroup("full", full, kv_heads, head_dim)),
        linear=lin,
        moe=MixtureOfExperts(need("num_experts"), need("num_experts_per_tok"),
                             need("moe_intermediate_size"),
                             c.get("shared_expert_intermediate_size") or 0),
    )


def _common_fields(c: dict[str, Any], name: str, need: Callable[[str], Any]) -> dict[str, Any]:
    heads = need("num_attention_heads")
    return {
        "name": name, "vocab_size": need("vocab_size"), "hidden_size": need("hidden_size"),
        "num_layers": need("num_hidden_layers"), "num_heads": heads,
        "num_kv_heads": c.get("num_key_value_heads") or heads,
        "intermediate_size": need("intermediate_size"),
        "max_position": need("max_position_embeddings"),
        "rope_theta": float(c.get("rope_theta") or 10000.0),
        "rms_eps": float(c.get("rms_norm_eps", 1e-6)),
        "dtype": c.get("torch_dtype") or c.get("dtype") or "bfloat16",
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "hf_architecture": c["architectures"][0],
    }


WRITERS: dict[str, Callable[[ModelPreset], dict[str, Any]]] = {
    "DeepseekV2ForCausalLM": lambda p: _deepseek_config(p, "deepseek_v2"),
    "DeepseekV3ForCausalLM": lambda p: _deepseek_config(p, "deepseek_v3"),
    "Gemma2ForCausalLM": _gemma2_config,
    "Qwen3NextForCausalLM": _qwen3_next_config,
}
READERS: dict[str, Callable[[dict[str, Any], str, Callable[[str], Any]], ModelPreset]] = {
    "DeepseekV2ForCausalLM": _deepseek_preset,
    "DeepseekV3ForCausalLM": _deepseek_preset,
    "Gemma2ForCausalLM": _gemma2_preset,
    "Qwen3NextForCausalLM": _qwen3_next_preset,
}
