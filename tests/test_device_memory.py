"""The simulated device's memory through real runs: components, preallocated vs on-demand KV,
the attention workspace, encoder outputs, tensor parallelism and out-of-memory outcomes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import make_workload, text_request
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sim.activations import ActivationModel, ForwardShape
from kvbench.engines.sim.caching_allocator import ROUND_LARGE
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.device_memory import NON_TORCH_BYTES, MemoryOptions
from kvbench.errors import KvbenchError
from kvbench.results.metrics import summarize
from kvbench.results.runlog import EngineRun
from kvbench.results.stepstats import device_columns
from kvbench.run.clocks import VirtualClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection
from kvbench.workloads.model import Request, Segment

LLAMA = get_preset("llama-2-7b")
GiB = 2**30
COMPONENTS = ("weights", "kv", "activation", "attention", "encoder", "kv_cached",
              "workspace_cached", "non_torch")


DEFAULT = MemoryOptions()


def _settings(kv_bytes: int, *, device: str = "sim:a100-80gb", memory: MemoryOptions = DEFAULT,
              chunked: bool = True, batched: int = 2048, seqs: int = 64) -> EngineSettings:
    return EngineSettings(
        preset=LLAMA, device=parse_device(device), kv_bytes=kv_bytes, block_size=16,
        prefix_caching=False, scheduler=SchedulerConfig(4096, seqs, batched, chunked),
        memory=memory,
    )


def _run(settings: EngineSettings, workload, engine: str = "paged") -> EngineRun:
    engine_ = build_engine(engine_config(engine, NAMED_ENGINES[engine], settings))
    clock = VirtualClock(CostModel(settings.preset, settings.device.hardware, settings.device.tp))
    return run_engine(engine_, workload, clock)


def _workload(prompt: int = 1024, output: int = 64, n: int = 8, gap_s: float = 0.05):
    return make_workload([text_request(f"r{i}", prompt, output, arrival=gap_s * i)
                          for i in range(n)])


def test_components_sum_to_the_reported_total() -> None:
    run = _run(_settings(8 * GiB), _workload())
    cols = device_columns(run.steps)
    parts = sum(cols[f"device_{n}_bytes"] for n in COMPONENTS)
    assert np.array_equal(parts, cols["device_used_bytes"])
    s = summarize(run)
    at_peak = [s[f"peak_device_{n}_bytes"] for n in COMPONENTS]
    assert sum(at_peak) == s["peak_device_bytes"]
    assert s["peak_device_weights_bytes"] == LLAMA.weight_bytes
    assert s["peak_device_kv_bytes"] == run.last_kv.capacity_bytes  # the whole pool


def test_preallocation_is_flat_from_the_start() -> None:
    settings = _settings(8 * GiB, batched=4096)
    run = _run(settings, _workload())
    used = device_columns(run.steps)["device_used_bytes"]
    profile = ActivationModel(LLAMA, 1, "fused", 16).peak(ForwardShape.profile(4096, 64)).total
    start = LLAMA.weight_bytes + run.last_kv.capacity_bytes + NON_TORCH_BYTES
    start += -(-profile // ROUND_LARGE) * ROUND_LARGE
    assert used.min() == used.max() == start
    s = summarize(run)
    assert s["device_growth_pct"] == s["memory_growth_pct"] == 0.0


def test_on_demand_grows_and_keeps_freed_memory_cached() -> None:
    run = _run(_settings(8 * GiB, memory=MemoryOptions(kv_allocation="on-demand")), _workload())
    cols = device_columns(run.steps)
    used, kv = cols["device_used_bytes"], cols["device_kv_bytes"]
    assert np.all(np.diff(used) >= 0)  # nothing goes back to the device without a failure
    assert used[-1] > used[0] + kv.max() / 2
    assert kv[-1] < kv.max()  # finished sequences' tensors were freed...
    assert cols["device_kv_cached_bytes"][-1] >= kv.max() - kv[-1]  # ...into the cache


def test_leaked_sequences_keep_their_tensors_on_demand() -> None:
    wl = _workload(prompt=512, output=32, n=6)
    settings = _settings(8 * GiB, memory=MemoryOptions(kv_allocation="on-demand"))
    leaky, paged = _run(settings, wl, "paged-leaky"), _run(settings, wl, "paged")
    # Every sequence's K and V hold its computed tokens: prompt + output - 1.
    held = wl.requests[0].prompt_tokens + wl.requests[0].output_tokens - 1
    assert device_columns(leaky.steps)["device_kv_bytes"][-1] == (
        len(wl.requests) * held * LLAMA.kv_bytes_per_token)
    # Freed ones go: the last step holds only the sequences finishing in it.
    last = max(t.finish_s for t in paged.timings.values())
    finishing = sum(t.finish_s == last for t in paged.timings.values())
    assert device_columns(paged.steps)["device_kv_bytes"][-1] == (
        finishing * held * LLAMA.kv_bytes_per_token)


def test_chunked_prefill_lowers_the_activation_peak() -> None:
    wl = _workload(prompt=4096 - 64, n=4, gap_s=0.0)
    on_demand = MemoryOptions(kv_allocation="on-demand")
    peaks = {}
    for chunked, batched in ((False, 16384), (True, 2048)):
        cols = device_columns(_run(_settings(8 * GiB, memory=on_demand, chunked=chunked,
                                             batched=batched), wl).steps)
        peaks[chunked] = (cols["device_activation_bytes"] + cols["device_attention_bytes"]).max()
    assert peaks[True] < peaks[False] / 4


def test_unfused_attention_adds_a_quadratic_workspace() -> None:
    def peak_attention(impl: str, prompt: int) -> float:
        options = MemoryOptions(attention_impl=impl)
        run = _run(_settings(8 * GiB, memory=options, batched=4096), _workload(prompt, n=1))
        return device_columns(run.steps)["device_attention_bytes"].max()

    ratio = peak_attention("sdpa-dense-mask", 4000) / peak_attention("sdpa-dense-mask", 2000)
    assert 3.5 < ratio < 4.1
    assert peak_attention("fused", 4000) < peak_attention("sdpa-dense-mask", 4000) / 100


def test_extra_window_costs_device_memory_on_demand_only() -> None:
    wl = _workload(prompt=256, output=8, n=2, gap_s=0.0)
    window = 4096
    kv = {}
    for allocation in ("preallocated", "on-demand"):
        for w in (0, window):
            options = MemoryOptions(kv_allocation=allocation, extra_kv_window_tokens=w)
            cols = device_columns(_run(_settings(8 * GiB, memory=options), wl).steps)
            kv[allocation, w] = cols["device_kv_bytes"][0]
    assert kv["preallocated", window] == kv["preallocated", 0]
    assert kv["on-demand", window] - kv["on-demand", 0] == 2 * window * LLAMA.kv_bytes_per_token


def test_encoder_outputs_live_until_their_tokens_are_prefilled() -> None:
    image = Segment("image", 576, "img/0", height=336, width=336, rule="llava-1.5")
    request = Request("mm", 0.0, (Segment("text", 64, "t/mm"), image,
                                  Segment("text", 2000, "t/mm2")), 16)
    run = _run(_settings(8 * GiB, batched=512), make_workload([request]))
    encoder = device_columns(run.steps)["device_encoder_bytes"]
    cached = 576 * LLAMA.hidden_size * LLAMA.dtype_bytes
    # Chunks of 512: the image spans the first two; its output is dropped after the second.
    assert list(encoder[:3]) == [cached, cached, 0]
    assert encoder[-1] == 0


def test_tensor_parallel_ranks_sum_to_the_whole() -> None:
    wl = _workload(n=2)
    one = summarize(_run(_settings(8 * GiB), wl))
    two = summarize(_run(_settings(8 * GiB, device="sim:a100-80gbx2"), wl))
    assert two["peak_device_weights_bytes"] == 2 * (LLAMA.weight_bytes // 2)
    assert two["peak_device_kv_bytes"] == one["peak_device_kv_bytes"]
    assert two["peak_device_non_torch_bytes"] == 2 * NON_TORCH_BYTES
    assert two["peak_device_bytes_per_rank"] * 2 == two["peak_device_bytes"]
    assert two["peak_device_bytes_per_rank"] < one["peak_device_bytes_per_rank"]


def _oom_workload():
    """Short requests that finish early, and long ones whose KV outgrows an A100-40GB."""
    short = [text_request(f"s{i}", 256, 8) for i in range(4)]
    long = [text_request(f"l{i}", 2048, 2000, arrival=0.5) for i in range(14)]
    return make_workload(short + long)


def test_on_demand_out_of_memory_fails_the_step_that_overflows() -> None:
    wl, kv_bytes = _oom_workload(), 40 * GiB
    options = MemoryOptions(kv_allocation="on-demand")
    big = _run(_settings(kv_bytes, device="sim:a100-80gb", memory=options), wl)
    small = _run(_settings(kv_bytes, device="sim:a100-40gb", memory=options), wl)
    assert big.status == "ok" and small.status == "failed"
    memory = parse_device("sim:a100-40gb").hardware.memory_bytes
    n = len(small.steps)
    assert small.error.startswith(f"step {n}: out of device memory in this step")
    big_used = device_columns(big.steps)["device_used_bytes"]
    small_used = device_columns(small.steps)["device_used_bytes"]
    # Identical until the larger device's run first holds more than the smaller device has;
    # there the smaller one's allocator released its free segments and went on, until a
    # step no release could fit.
    first_over = int(np.argmax(big_used > memory))
    assert 0 < first_over < n
    assert np.array_equal(small_used[:first_over], big_used[:first_over])
    assert small_used[first_over] < big_used[first_over]
    assert small_used.max() <= memory
    s = summarize(small)
    assert s["completed"] == 4  # the short requests finished before and are kept
    assert s["device_oom_needed_bytes"] > s["device_oom_memory_bytes"] == memory
    assert s["device_oom_free_bytes"] == memory - small_used[-1]
    assert sum(s[f"device_oom_{c}_bytes"] for c in COMPONENTS) == s["device_oom_needed_bytes"]


def test_preallocated_step_beyond_the_profile_runs_out_of_memory() -> None:
    """vLLM's profile batch spreads the token budget over many short sequences; with an
    unfused kernel one long prompt needs far more workspace than the profile reserved."""
    wl = make_workload([text_request("s", 256, 4), text_request("long", 16000, 4, arrival=1.0)])
    options = MemoryOptions(attention_impl="eager")
    preset = get_preset("qwen2.5-7b")
    settings = EngineSettings(
        preset=preset, device=parse_device("sim:a100-80gb"), kv_bytes=40 * GiB, block_size=16,
        prefix_caching=False, scheduler=SchedulerConfig(16384, 256, 16384, False), memory=options,
    )
    run = _run(settings, wl)
    assert run.status == "failed" and "out of device memory in this step" in run.error
    assert run.timings["s"].status == "ok" and run.timings["long"].status == "unfinished"
    assert summarize(run)["device_oom_attention_bytes"] > 40 * GiB


def _suite(**run: object) -> Suite:
    return Suite(
        name="devmem", workload=WorkloadSection(spec={
            "num_requests": 4,
            "classes": [{"name": "c", "prompt": {"kind": "fixed", "value": 256},
                         "output": {"kind": "fixed", "value": 16}}],
        }),
        model=ModelSection(preset="llama-2-7b"), run=RunSection(engines=["paged"], **run),
    )


def test_preallocation_that_does_not_fit_fails_to_start(tmp_path: Path) -> None:
    from kvbench.run.execute import execute_plan

    suite = _suite(device="sim:a100-40gb", kv_memory="30GiB")
    (record,) = execute_plan(plan_run(suite, None, tmp_path / "out", "test"))
    assert record.status == "failed"
    assert record.error.startswith("engine failed to start: out of device memory at start-up")
    s = record.summary
    assert s["device_oom_needed_bytes"] > s["device_oom_memory_bytes"]
    assert s["device_oom_kv_bytes"] == 30 * GiB
    assert all(r.status == "unfinished" for r in record.requests)


def test_memory_options_are_refused_on_measured_devices(tmp_path: Path) -> None:
    from kvbench.run.overrides import RunFlags, resolve_suite

    with pytest.raises(KvbenchError, match="simulated device"):
        plan_run(_suite(device="cpu", attention_impl="eager"), None, tmp_path / "o", "test")
    # Another device on the command line drops the suite's model of its simulated device.
    suite, _ = resolve_suite("seed-blowup", RunFlags(device="cpu"))
    assert (suite.run.attention_impl, suite.run.extra_kv_window_tokens) == ("fused", 0)


def test_on_demand_budget_is_the_device_less_the_weights(tmp_path: Path) -> None:
    plan = plan_run(_suite(device="sim:a100-80gb", kv_allocation="on-demand"), None,
                    tmp_path / "o", "test")
    memory = parse_device("sim:a100-80gb").hardware.memory_bytes
    assert plan.settings.kv_bytes == memory - LLAMA.weight_bytes


def test_blowup_suites_run_and_the_fixes_lower_the_on_demand_peak(tmp_path: Path) -> None:
    from kvbench.run.execute import execute_plan
    from kvbench.run.overrides import RunFlags, resolve_suite

    peaks = {}
    for name in ("seed-blowup", "seed-blowup-fixed"):
        suite, base = resolve_suite(name, RunFlags(num_requests=8, kv_allocation="on-demand"))
        (record,) = execute_plan(plan_run(suite, base, tmp_path / name, "test"))
        assert record.status == "ok", record.error
        assert record.model["name"] == "deepseek-r1-distill-qwen-7b"
        peaks[name] = record.summary["peak_device_bytes"]
    assert peaks["seed-blowup-fixed"] < peaks["seed-blowup"]
