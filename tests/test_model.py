"""The Llama-style decoder over a flat varlen batch: chunking, layouts, a dense oracle."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_driver import SMALL, Runner, make_model, prompts

from kvbench.engines.model.llama import LlamaForCausalLM, apply_rope, greedy, linear, rope_cos_sin


def dense_logits(model: LlamaForCausalLM, ids: np.ndarray) -> torch.Tensor:
    """An independent dense forward (no cache, textbook causal attention) for one sequence."""
    p = model.preset
    x = model.embed(torch.from_numpy(ids))
    n = x.shape[0]
    cos, sin = rope_cos_sin(torch.arange(n), p.head_dim, p.rope_theta)
    for layer in model.model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(a.q_proj(h).view(n, p.num_heads, p.head_dim), cos, sin).transpose(0, 1)
        k = apply_rope(a.k_proj(h).view(n, p.num_kv_heads, p.head_dim), cos, sin).transpose(0, 1)
        v = a.v_proj(h).view(n, p.num_kv_heads, p.head_dim).transpose(0, 1)
        group = p.num_heads // p.num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        x = x + a.o_proj(o.to(x.dtype).transpose(0, 1).reshape(n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(model.model.norm(x), head).float()


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize(
    "preset",
    [SMALL, replace(SMALL, qkv_bias=True, tie_embeddings=True, hf_architecture="Qwen2ForCausalLM")],
    ids=["llama", "qwen2"],
)
def test_matches_dense_oracle(layout, preset):
    model = make_model(preset)
    (ids,) = prompts([37])
    runner = Runner(model, layout, 1)
    got = runner.step([(0, ids, 0)])[0]
    with torch.inference_mode():
        want = dense_logits(model, ids)[-1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_equals_one_shot():
    model = make_model()
    (ids,) = prompts([45])
    one = Runner(model, "paged", 1).step([(0, ids, 0)])[0]
    runner = Runner(model, "paged", 1)
    for start, end in [(0, 13), (13, 14), (14, 45)]:
        chunked = runner.step([(0, ids[start:end], start)])[0]
    torch.testing.assert_close(chunked, one, atol=1e-5, rtol=1e-5)
    ps = prompts([45, 20, 31], seed=2)
    one_shot = Runner(model, "paged", 3).generate(ps, 8)
    assert Runner(model, "paged", 3).generate(ps, 8, chunk=7) == one_shot


def test_paged_and_contiguous_give_identical_tokens():
    model = make_model()
    ps = prompts([30, 5, 61, 17], seed=3)
    paged = Runner(model, "paged", 4).generate(ps, 12, chunk=16)
    contiguous = Runner(model, "contiguous", 4).generate(ps, 12, chunk=16)
    assert paged == contiguous
    assert len({tok for seq in paged for tok in seq}) > 4  # not a degenerate model


def test_recompute_continues_the_same_sequence():
    """After preemption the prompt plus generated tokens are prefilled again; the next token
    must be the one continued decoding gives."""
    model = make_model()
    (ids,) = prompts([25])
    tokens = Runner(model, "contiguous", 1).generate([ids], 6)[0]
    again = Runner(model, "paged", 1).step([(0, np.concatenate([ids, tokens[:5]]), 0)])
    assert greedy(again).tolist() == [tokens[5]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_tracks_float32(dtype):
    (ids,) = prompts([40])
    ref = Runner(make_model(), "paged", 1).step([(0, ids, 0)])[0]
    low = Runner(make_model(SMALL.with_dtype(dtype)), "paged", 1).step([(0, ids, 0)])[0]
    assert low.dtype == torch.float32
    assert torch.corrcoef(torch.stack([ref, low]))[0, 1] > 0.99


def test_random_logits_are_spread():
    (ids,) = prompts([20])
    logits = Runner(make_model(), "paged", 1).step([(0, ids, 0)])[0]
    assert 0.05 < logits.std().item() < 5.0


def test_cpu_float32_matmul_weights_are_column_major():
    """On the CPU in float32 every weight that goes through ``F.linear`` (fused q/k/v and
    gate/up included) is stored column-major, the embedding row-major (it is gathered by
    row); in half precision all stay row-major. The seeded values are the layout's own
    business: the same model either way."""
    model = make_model()
    mats = {n: p for n, p in model.named_parameters() if p.dim() == 2}
    embed = mats.pop("model.embed_tokens.weight")
    assert embed.is_contiguous()
    assert len(mats) == 1 + SMALL.num_layers * 7
    # Column-major: unit stride down a column (the parts of a fused weight are row ranges
    # of it, each column's stride the whole's row count).
    assert [n for n, p in mats.items() if p.stride()[0] != 1] == []
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_weight.stride() == (1, layer.self_attn.qkv_weight.shape[0])
    assert layer.mlp.gate_up_weight.stride() == (1, layer.mlp.gate_up_weight.shape[0])
    half = make_model(SMALL.with_dtype("bfloat16"))
    assert all(p.is_contiguous() for p in half.parameters())
    for (name, p), (_, h) in zip(model.named_parameters(), half.named_parameters(), strict=True):
        assert torch.equal(p.to(torch.bfloat16), h), name


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_cpu_float32_matmuls_run_on_packed_weights():
    """On the CPU in float32 the forward's matmuls (fused q/k/v, o, fused gate/up, down, LM
    head) run on packed copies of their weights, equal to ``F.linear`` over the parameters
    up to float32 rounding; in half precision nothing is packed. The copies are counted."""
    model = make_model()
    layer = model.model.layers[0]
    pairs = [(layer.self_attn.qkv_weight, layer.self_attn.qkv_packed),
             (layer.self_attn.o_proj.weight, layer.self_attn.o_packed),
             (layer.mlp.gate_up_weight, layer.mlp.gate_up_packed),
             (layer.mlp.down_proj.weight, layer.mlp.down_packed),
             (model.head_weight, model.head_packed)]
    gen = torch.Generator().manual_seed(0)
    for weight, packed in pairs:
        assert packed is not None
        for rows in (1, 7, 300):
            x = torch.randn(rows, weight.shape[1], generator=gen)
            torch.testing.assert_close(linear(x, weight, packed), F.linear(x, weight),
                                       atol=1e-5, rtol=1e-5)
    weights = sum(w.nbytes for w, _ in pairs) + (SMALL.num_layers - 1) * sum(
        w.nbytes for w, _ in pairs[:4])
    assert model.packed_bytes() == weights
    half = make_model(SMALL.with_dtype("bfloat16"))
    assert half.packed_bytes() == 0 and half.model.layers[0].mlp.gate_up_packed is None
