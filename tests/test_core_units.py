"""Units, devices, cost model, suites and curves: the small pure pieces of the core."""

from __future__ import annotations

import pytest

from kvbench.engines.base import BatchShape
from kvbench.engines.model.presets import get_preset
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import get_gpu
from kvbench.errors import KvbenchError
from kvbench.results.curves import build_curves
from kvbench.results.runlog import StepLog
from kvbench.run.devices import kv_budget_bytes, parse_device
from kvbench.run.suite import load_suite
from kvbench.units import format_bytes, parse_bytes


def test_parse_bytes() -> None:
    assert parse_bytes("64MiB") == 64 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096B") == parse_bytes(4096) == 4096
    for bad in ("", "12 parsecs", "-5MiB", "0", "4096"):
        with pytest.raises(KvbenchError):
            parse_bytes(bad)
    assert format_bytes(1536) == "1.5 KiB"


def test_preset_facts() -> None:
    assert get_preset("llama-2-7b").kv_bytes_per_token == 512 * 1024
    assert get_preset("llama-3-8b").kv_bytes_per_token == 128 * 1024
    assert get_preset("qwen2.5-7b").kv_bytes_per_token == 56 * 1024
    assert get_preset("deepseek-r1-distill-qwen-7b").kv_bytes_per_token == 56 * 1024
    assert round(get_preset("llama-3-8b").num_params / 1e9, 2) == 8.03
    assert round(get_preset("qwen2.5-7b").num_params / 1e9, 2) == 7.62
    # 4 KV heads over 8 ranks: each rank holds one head (replicated), i.e. a quarter.
    assert get_preset("qwen2.5-7b").kv_bytes_per_token_per_rank(8) == 14 * 1024
    with pytest.raises(KvbenchError, match="valid presets"):
        get_preset("gpt-5")


def test_parse_device() -> None:
    d = parse_device("sim:a100-80gbx8")
    assert (d.kind, d.gpu.name, d.tp, d.label) == ("sim", "a100-80gb", 8, "sim:a100-80gbx8")
    assert parse_device("sim:h200").tp == 1
    assert parse_device("cpu").kind == "cpu"
    with pytest.raises(KvbenchError, match="valid GPUs"):
        parse_device("sim:tpu-v9")
    with pytest.raises(KvbenchError, match="unknown device"):
        parse_device("quantum")


def test_cuda_without_cuda_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(KvbenchError, match="--device cpu"):
        parse_device("cuda")


def test_kv_budget_after_weights() -> None:
    p = get_preset("llama-3-8b")
    d = parse_device("sim:a100-80gb")
    budget = kv_budget_bytes(d, p, kv_memory=None, gpu_memory_utilization=0.9,
                             max_num_batched_tokens=2048, max_num_seqs=64)
    assert 0 < budget < 0.9 * 80 * 2**30 - p.weight_bytes
    with pytest.raises(KvbenchError, match="tensor parallelism"):
        kv_budget_bytes(parse_device("sim:l40s"), get_preset("llama-3-70b"), kv_memory=None,
                        gpu_memory_utilization=0.9, max_num_batched_tokens=2048, max_num_seqs=64)
    tp8 = kv_budget_bytes(parse_device("sim:a100-80gbx8"), get_preset("llama-3-70b"),
                          kv_memory=None, gpu_memory_utilization=0.9,
                          max_num_batched_tokens=2048, max_num_seqs=64)
    assert tp8 > 8 * 50 * 2**30


def test_cost_model_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    p, gpu = get_preset("llama-3-8b"), get_gpu("a100-80gb")
    cm = CostModel(p, gpu)
    decode = cm.step_time_s(BatchShape(num_seqs=1, decode_tokens=1, context_tokens=100))
    # One decode step reads all weights once: ~16 GB at 2 TB/s x 0.8 efficiency ~ 10 ms.
    expected = cm.coef.overhead_s + p.weight_bytes / (gpu.hbm_bytes_per_s * 0.8)
    assert decode == pytest.approx(expected, rel=0.01)
    prefill = cm.step_time_s(BatchShape(num_seqs=1, prefill_tokens=8192, context_tokens=8192,
                                        attn_pairs=8192 * 8193 // 2))
    assert prefill > 10 * decode
    assert cm.step_time_s(BatchShape()) == 0.0
    tp = CostModel(p, gpu, tp=2).step_time_s(BatchShape(num_seqs=1, decode_tokens=1))
    assert tp < decode


def test_embedded_suites_load() -> None:
    suite, base = load_suite(None)
    assert suite.name == "default" and base is not None and base.name == "suites"
    assert suite.run.engines == ["contiguous", "contiguous-request", "paged"]
    assert suite.run.request_rate == float("inf")
    with pytest.raises(KvbenchError, match="default"):
        load_suite("no-such-suite")


def test_bad_suite_names_file(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nmax_num_seqs = -1\n')
    with pytest.raises(KvbenchError, match=r"bad\.toml.*max_num_seqs"):
        load_suite(str(bad))
    broken = tmp_path / "broken.toml"
    broken.write_text("[run\n")
    with pytest.raises(KvbenchError, match="invalid TOML"):
        load_suite(str(broken))


def test_curves_keep_peaks_when_downsampling() -> None:
    steps = StepLog()
    n = 5000
    for i in range(n):
        steps.t_s.append(float(i))
        steps.dt_s.append(1.0)
        steps.num_tokens.append(1)
        steps.running.append(1)
        steps.waiting.append(0)
        steps.preempted.append(1 if i == 1234 else 0)
        steps.kv_reserved_bytes.append(10_000 if i == 4321 else i)
        steps.kv_used_bytes.append(i // 2)
        steps.kv_free_bytes.append(100 if i == 777 else 20_000 - i)
        steps.kv_largest_free_bytes.append(10 if i == 777 else 20_000 - i)
        for col in ("kv_shared_bytes", "prefix_hit_tokens", "block_allocs", "block_frees"):
            getattr(steps, col).append(0)
    curves = build_curves(steps, max_points=100)
    assert len(curves["t_s"]) == 100
    assert max(curves["kv_reserved_bytes"]) == 10_000
    assert min(curves["kv_free_bytes"]) == 100
    assert min(curves["frag_index"]) == pytest.approx(0.1)
    assert sum(curves["preempted"]) == 1
    assert curves["t_s"][-1] == n - 1
