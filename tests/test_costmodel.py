"""The roofline cost model: its formula, the split-attention form and tensor parallelism."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvbench.engines.base import BatchShape
from kvbench.engines.model.presets import get_preset
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import CostCoefficients, Hardware, get_gpu
from kvbench.errors import KvbenchError
from kvbench.run.devices import parse_device


def _decode(seqs: int, ctx: int) -> BatchShape:
    return BatchShape(num_seqs=seqs, decode_tokens=seqs, context_tokens=seqs * ctx,
                      attn_pairs=seqs * ctx)


def _prefill(tokens: int) -> BatchShape:
    return BatchShape(num_seqs=1, prefill_tokens=tokens, context_tokens=tokens,
                      attn_pairs=tokens * (tokens + 1) // 2)


def test_default_step_time_is_the_single_roofline_by_hand() -> None:
    p, gpu = get_preset("llama-3-8b"), get_gpu("a100-80gb")
    batch = _decode(8, 1000)
    flops = (2 * p.active_layer_params * 8 + 2 * p.vocab_size * p.hidden_size * 8
             + 4 * p.num_layers * p.num_heads * p.head_dim * 8000)
    nbytes = p.weight_bytes + (8000 + 8) * p.kv_bytes_per_token
    expected = 3e-3 + max(flops / (312e12 * 0.6), nbytes / (2.039e12 * 0.8))
    assert CostModel(p, gpu).step_time_s(batch) == expected  # exactly: baselines depend on it


def test_device_coefficients_apply_unless_overridden() -> None:
    p = get_preset("llama-3-8b")
    slow = replace(get_gpu("a100-80gb"), coef=CostCoefficients(bandwidth_efficiency=0.4))
    fast = CostModel(p, get_gpu("a100-80gb")).step_time_s(_decode(1, 100))
    assert CostModel(p, slow).step_time_s(_decode(1, 100)) > 1.9 * (fast - 3e-3)
    override = CostModel(p, slow, coef=CostCoefficients())
    assert override.step_time_s(_decode(1, 100)) == fast


def test_split_attention_adds_an_attention_roofline() -> None:
    p, gpu = get_preset("tiny"), get_gpu("a100-80gb")
    coef = CostCoefficients(flops_efficiency=0.5, bandwidth_efficiency=0.5, overhead_s=1e-3,
                            per_seq_s=1e-4, attention_flops_efficiency=0.1,
                            attention_bandwidth_efficiency=0.2)
    cm = CostModel(p, gpu, coef=coef)
    batch = _decode(4, 512)
    r = cm.terms(batch)
    linear = max((r.flops - r.attention_flops) / (gpu.flops_per_s * 0.5),
                 (r.nbytes - r.kv_bytes) / (gpu.hbm_bytes_per_s * 0.5))
    attention = max(r.attention_flops / (gpu.flops_per_s * 0.1),
                    r.kv_bytes / (gpu.hbm_bytes_per_s * 0.2))
    assert cm.step_time_s(batch) == pytest.approx(1e-3 + 4e-4 + linear + attention)
    assert r.kv_bytes == (4 * 512 + 4) * p.kv_bytes_per_token


def test_coefficients_validate_and_round_trip() -> None:
    with pytest.raises(KvbenchError, match="both attention"):
        CostCoefficients(attention_flops_efficiency=0.1).validate()
    with pytest.raises(KvbenchError, match="positive"):
        CostCoefficients(flops_efficiency=0).validate()
    hw = replace(get_gpu("h200"), coef=CostCoefficients(per_seq_s=2e-5))
    assert Hardware.from_json(hw.to_json()) == hw


def test_tp_splits_weights_and_kv_heads_per_rank() -> None:
    p = get_preset("llama-3-70b")  # 8 KV heads
    gpu = get_gpu("a100-80gb")
    one = CostModel(p, gpu).terms(_decode(1, 0))
    eight = CostModel(p, gpu, tp=8).terms(_decode(1, 0))
    assert eight.nbytes == pytest.approx(one.nbytes / 8)
    assert eight.flops == pytest.approx(one.flops / 8)
    assert one.allreduce_s == 0 and eight.allreduce_s > 0
    q = get_preset("qwen2.5-7b")  # 4 KV heads: TP8 replicates them in pairs
    assert q.kv_bytes_per_token_per_rank(8) == q.kv_bytes_per_token // 4


def test_decode_time_falls_with_tp_until_allreduce_dominates() -> None:
    big, gpu = get_preset("llama-3-70b"), get_gpu("a100-80gb")
    times = [CostModel(big, gpu, tp=t).step_time_s(_decode(32, 2048)) for t in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    # A model this small reads its weights in microseconds: launch latency of two
    # all-reduces per layer then outweighs the split, so more ranks only cost time.
    tiny = get_preset("tiny")
    small = [CostModel(tiny, gpu, tp=t).step_time_s(_decode(32, 2048)) for t in (1, 2, 4, 8)]
    assert min(small) == small[0] < small[-1]
    # Over PCIe a big prefill's all-reduces eat most of what TP8 saves over TP4.
    pcie = get_gpu("l40s")
    tp4, tp8 = (CostModel(big, pcie, tp=t) for t in (4, 8))
    r = tp8.terms(_prefill(8192))
    assert r.allreduce_s > 0.3 * tp8.step_time_s(_prefill(8192))
    assert tp8.step_time_s(_prefill(8192)) > 0.6 * tp4.step_time_s(_prefill(8192))


def test_sim_device_with_tp_uses_per_rank_figures() -> None:
    d = parse_device("sim:h200x4")
    assert d.tp == 4 and d.label == "sim:h200x4" and d.hardware.name == "h200"


def test_map_ops_cost_their_latency_per_rank_and_nothing_when_absent() -> None:
    p, gpu = get_preset("llama-3-8b"), get_gpu("a100-80gb")
    batch = _decode(8, 1000)
    base = CostModel(p, gpu).step_time_s(batch)
    mapped = CostModel(p, gpu).step_time_s(replace(batch, map_ops=64))
    assert mapped == pytest.approx(base + 64 * CostCoefficients().map_op_s)
    two = CostModel(p, gpu, tp=2)
    assert two.step_time_s(replace(batch, map_ops=64)) == pytest.approx(
        two.step_time_s(batch) + 32 * CostCoefficients().map_op_s
    )
    # Unmapping pages with nothing scheduled takes just the calls' time.
    assert CostModel(p, gpu).step_time_s(BatchShape(map_ops=10)) == pytest.approx(10e-5)
    assert CostModel(p, gpu).step_time_s(BatchShape()) == 0.0
    with pytest.raises(KvbenchError, match="map_op_s"):
        CostCoefficients(map_op_s=-1.0).validate()
