"""The simulated GPU's KV budget is vLLM 0.32.0's rule (``Worker.determine_available_memory``):
0.9 x memory - weights - the profiling forward's activation peak - non-torch memory, by hand."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import pytest

from kvbench.engines.model.presets import get_preset
from kvbench.engines.sim.activations import ActivationModel, ForwardShape
from kvbench.engines.sim.device_memory import NON_TORCH_BYTES
from kvbench.engines.sim.hardware import SOURCED_NON_TORCH_BYTES, DeviceSpec, Hardware, get_gpu
from kvbench.engines.sim.kv_budget import profile_activation_bytes
from kvbench.errors import KvbenchError
from kvbench.run.devices import gpu_kv_budget, kv_budget_bytes, parse_device
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection

GiB = 2**30
# The suite defaults (kvbench/run/suite.py).
UTIL, BATCHED, SEQS = 0.9, 8192, 256


def _budget(device: str, preset: str, batched: int = BATCHED, util: float = UTIL) -> int:
    return kv_budget_bytes(parse_device(device), get_preset(preset), kv_memory=None,
                           gpu_memory_utilization=util, max_num_batched_tokens=batched,
                           max_num_seqs=SEQS)


def _mlp_phase_bytes(preset: str, tokens: int, seqs: int) -> int:
    """The profiling forward's peak by hand: with fused attention and 8192 tokens the MLP
    phase is the largest, on top of what the whole forward holds."""
    p = get_preset(preset)
    t, h, b = tokens, p.hidden_size, p.dtype_bytes
    whole = 3 * t * 8 + seqs * 8 + t * p.head_dim * 4 + t * h * b  # ids/positions/slots, RoPE
    return whole + t * h * b + 2 * t * h * b + 3 * t * p.intermediate_size * b


@pytest.mark.parametrize(("device", "preset"), [("sim:a100-80gb", "llama-3-8b"),
                                                 ("sim:h100-sxm", "llama-2-7b")])
def test_budget_is_vllms_rule_term_by_term(device: str, preset: str) -> None:
    d, p = parse_device(device), get_preset(preset)
    terms = gpu_kv_budget(d, p, gpu_memory_utilization=UTIL, max_num_batched_tokens=BATCHED,
                          max_num_seqs=SEQS)
    assert terms.requested_bytes == math.ceil(d.hardware.memory_bytes * UTIL)
    assert terms.weights_bytes == p.weight_bytes
    peak = ActivationModel(p).peak(ForwardShape.profile(BATCHED, SEQS))
    assert peak.phase == "mlp"
    assert terms.activation_peak_bytes == _mlp_phase_bytes(preset, BATCHED, SEQS)
    assert terms.non_torch_bytes == SOURCED_NON_TORCH_BYTES == int(0.16 * GiB)
    assert terms.cudagraph_bytes == 0  # the simulated engines run eagerly
    by_hand = (math.ceil(d.hardware.memory_bytes * UTIL) - p.weight_bytes
               - _mlp_phase_bytes(preset, BATCHED, SEQS) - int(0.16 * GiB))
    assert terms.kv_bytes == by_hand == _budget(device, preset)


def test_tensor_parallel_ranks_each_pay_their_share() -> None:
    p, tp = get_preset("llama-3-70b"), 4
    per_rank = (math.ceil(81920 * 2**20 * UTIL) - p.weight_bytes // tp
                - profile_activation_bytes(p, tp, BATCHED, SEQS) - SOURCED_NON_TORCH_BYTES)
    assert _budget(f"sim:a100-80gbx{tp}", "llama-3-70b") == tp * per_rank


def test_a_larger_profiling_batch_lowers_the_budget_by_its_activations() -> None:
    p = get_preset("llama-3-8b")
    peaks = {n: ActivationModel(p).peak(ForwardShape.profile(n, SEQS)).total
             for n in (8192, 16384)}
    drop = _budget("sim:a100-80gb", "llama-3-8b", 8192) - _budget("sim:a100-80gb", "llama-3-8b",
                                                                     16384)
    assert drop == peaks[16384] - peaks[8192] > 0


def test_the_profile_follows_the_attention_kernel() -> None:
    # vLLM profiles with the kernel it runs: an unfused one's workspace (one 8192-token
    # prompt here) comes off the pool.
    d, p = parse_device("sim:a100-80gb"), get_preset("llama-3-8b")
    fused, sdpa = (gpu_kv_budget(d, p, gpu_memory_utilization=UTIL, max_num_batched_tokens=BATCHED,
                                 max_num_seqs=1, attention=impl, page_tokens=16)
                   for impl in ("fused", "sdpa-dense-mask"))
    peak = ActivationModel(p, 1, "sdpa-dense-mask", 16).peak(ForwardShape.profile(BATCHED, 1))
    assert peak.phase == "attention"
    assert sdpa.activation_peak_bytes == peak.total > fused.activation_peak_bytes
    assert fused.kv_bytes - sdpa.kv_bytes == peak.total - fused.activation_peak_bytes > 0


def test_a_saved_device_without_the_field_gets_the_sourced_fallback() -> None:
    saved = asdict(get_gpu("a100-80gb"))
    del saved["non_torch_bytes"]
    hw = Hardware.from_json(saved)
    assert hw.non_torch_bytes == SOURCED_NON_TORCH_BYTES
    budget = kv_budget_bytes(DeviceSpec("sim", None, hw), get_preset("llama-3-8b"),
                             kv_memory=None, gpu_memory_utilization=UTIL,
                             max_num_batched_tokens=BATCHED, max_num_seqs=SEQS)
    assert budget == _budget("sim:a100-80gb", "llama-3-8b")
    with pytest.raises(KvbenchError, match="non_torch_bytes"):
        Hardware.from_json({**saved, "non_torch_bytes": -1})


def test_weights_that_leave_no_room_say_so() -> None:
    with pytest.raises(KvbenchError, match=r"weights take .* tensor parallelism"):
        _budget("sim:l40s", "llama-3-70b")
    # Weights alone fit, but not with the profile's activations and non-torch memory.
    p, gpu = get_preset("llama-3-8b"), get_gpu("a100-80gb")
    util = (p.weight_bytes + 2**20) / gpu.memory_bytes
    with pytest.raises(KvbenchError, match=r"activation peak .* non-torch memory"):
        _budget("sim:a100-80gb", "llama-3-8b", util=util)


def test_explicit_and_cpu_budgets_are_unchanged() -> None:
    assert kv_budget_bytes(parse_device("sim:a100-80gb"), get_preset("llama-3-8b"),
                           kv_memory=3 * GiB, gpu_memory_utilization=UTIL,
                           max_num_batched_tokens=BATCHED, max_num_seqs=SEQS) == 3 * GiB
    assert _budget("cpu", "tiny") == 256 * 2**20


def test_the_preallocated_device_holds_what_vllm_requested(tmp_path: Path) -> None:
    """With vLLM's rule, weights + pool + profile peak + non-torch memory fill the requested
    memory whatever the profiling batch (the pool gives back what the profile takes); the
    simulated device also shows the CUDA context vLLM leaves outside the request."""
    from kvbench.run.execute import execute_plan
    from kvbench.run.plan import plan_run

    gpu, p = get_gpu("a100-80gb"), get_preset("llama-3-8b")
    requested = math.ceil(gpu.memory_bytes * UTIL)
    block = 16 * p.kv_bytes_per_token
    peaks = []
    for batched in (2048, 8192):
        suite = Suite(
            name="budget", workload=WorkloadSection(spec={
                "num_requests": 4,
                "classes": [{"name": "c", "prompt": {"kind": "fixed", "value": 512},
                             "output": {"kind": "fixed", "value": 8}}],
            }),
            model=ModelSection(preset="llama-3-8b"),
            run=RunSection(engines=["paged"], device="sim:a100-80gb",
                           max_num_batched_tokens=batched),
        )
        (record,) = execute_plan(plan_run(suite, None, tmp_path / str(batched), "test"))
        assert record.status == "ok", record.error
        peak = record.summary["peak_device_bytes"] - NON_TORCH_BYTES + gpu.non_torch_bytes
        # Whole blocks round the pool down, 2 MiB segments round the workspace up.
        assert requested - block < peak < requested + 2 * 2**20
        peaks.append(record.summary["peak_device_bytes"])
    assert abs(peaks[0] - peaks[1]) < block + 2 * 2**20
