"""Telemetry probes: availability is stated, readings are rate-limited and step-aligned."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from test_harness import ScriptedEngine

from helpers import make_workload, text_request
from kvbench.results.curves import build_curves
from kvbench.results.metrics import summarize
from kvbench.run.clocks import WallClock
from kvbench.run.harness import WARMUP_FRACTION, run_engine
from kvbench.run.telemetry import (
    CudaProbe,
    NvmlProbe,
    Probe,
    RssProbe,
    Telemetry,
    _open_nvml,
    open_probes,
)


class CountingProbe(Probe):
    name = "count"
    columns = ("count_bytes",)
    period_s = 1.0

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> tuple[int, ...]:
        self.reads += 1
        return (self.reads,)


def test_rss_probe_reads_this_process() -> None:
    probe = RssProbe()
    (rss,) = probe.read()
    probe.close()
    assert 10 * 2**20 < rss < 64 * 2**30


@pytest.mark.parametrize("kind", ["cpu", "sim"])
def test_probes_off_cuda_say_why(kind: str) -> None:
    probes, status = open_probes(kind, "cpu" if kind == "cpu" else None)
    assert [p.name for p in probes] == ["rss"]
    assert status["rss"] == "ok"
    for name in ("cuda", "nvml"):
        assert status[name].startswith("unavailable: ")
    for p in probes:
        p.close()


def test_nvml_missing_or_broken_is_unavailable(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    probe, status = _open_nvml("cuda:0")
    assert probe is None and "pynvml not installed" in status

    def fail() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=fail))
    probe, status = _open_nvml("cuda:0")
    assert probe is None and "did not initialise" in status and "Not Found" in status


def _fake_nvml(pids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * 2**30, used=5 * 2**30),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            SimpleNamespace(pid=p, usedGpuMemory=3 * 2**30) for p in pids
        ],
        nvmlShutdown=lambda: None,
    )


def test_nvml_probe_reads_device_and_own_process() -> None:
    import os

    own = os.getpid()
    probe = NvmlProbe(
        _fake_nvml([1, own]), handle=object(), per_process=True, pids=lambda: {own}
    )
    assert probe.columns == ("nvml_device_used_bytes", "nvml_process_used_bytes")
    assert probe.read() == (5 * 2**30, 3 * 2**30)
    assert probe.info() == {"device_total_bytes": 80 * 2**30}
    device_only = NvmlProbe(
        _fake_nvml([1]), handle=object(), per_process=False, pids=lambda: {own}
    )
    assert device_only.columns == ("nvml_device_used_bytes",)
    assert device_only.read() == (5 * 2**30,)


def test_cuda_probe_reads_allocator_stats() -> None:
    stats = {
        "allocated_bytes.all.current": 100, "reserved_bytes.all.current": 200,
        "inactive_split_bytes.all.current": 30, "num_alloc_retries": 2,
        "allocated_bytes.all.peak": 150, "reserved_bytes.all.peak": 256,
    }
    resets = []
    cuda = SimpleNamespace(
        memory_stats=lambda dev: stats, reset_peak_memory_stats=resets.append
    )
    probe = CudaProbe(SimpleNamespace(cuda=cuda, device=lambda d: d), "cuda:0")
    assert resets == ["cuda:0"]
    assert dict(zip(probe.columns, probe.read(), strict=True)) == {
        "cuda_allocated_bytes": 100, "cuda_reserved_bytes": 200, "cuda_inactive_split_bytes": 30,
        "cuda_alloc_retries": 2, "cuda_peak_allocated_bytes": 150,
        "cuda_peak_reserved_bytes": 256,
    }


def test_sampling_is_rate_limited_and_forced_reads_replace() -> None:
    probe = CountingProbe()
    tel = Telemetry([probe], {"count": "ok"})
    for step, wall in enumerate([0.0, 0.4, 0.9, 1.0, 1.5, 2.2]):
        if wall >= tel.next_due_s:
            tel.sample(step, wall)
    assert tel.samples["count"].steps == [0, 3, 5]
    tel.sample(5, 2.3, force=True)  # same step: replaced, not duplicated
    assert tel.samples["count"].steps == [0, 3, 5]
    assert tel.latest() == {"count_bytes": 4}


def test_harness_samples_first_warmup_and_last_step() -> None:
    wl = make_workload([text_request(f"r{i}", 10, 3 + i) for i in range(20)])
    probe = CountingProbe()
    probe.period_s = 3600.0  # only the first and the forced readings
    run = run_engine(ScriptedEngine(), wl, WallClock(), telemetry=Telemetry([probe], {}))
    assert run.status == "ok"
    last = len(run.steps) - 1
    # ScriptedEngine finishes r0 (3 tokens) at step 2: 10% of 20 requests = 2 finish at step 3.
    assert WARMUP_FRACTION == 0.1
    assert run.warmup_step == 3
    assert run.telemetry.samples["count"].steps == [0, 3, last]
    curves = build_curves(run.steps, run.telemetry)
    assert len(curves["count_bytes"]) == len(curves["t_s"])
    assert curves["count_bytes"][0] == 1 and curves["count_bytes"][-1] == 3


def test_overhead_is_measured() -> None:
    wl = make_workload([text_request(f"r{i}", 10, 20) for i in range(10)])
    run = run_engine(ScriptedEngine(), wl, WallClock())
    s = summarize(run)
    assert 0 < run.telemetry_wall_s < run.step_wall_s <= run.wall_time_s
    assert s["telemetry_overhead_pct"] == pytest.approx(
        100 * run.telemetry_wall_s / run.step_wall_s
    )
    assert s["peak_rss_bytes"] > 0
    assert s["peak_device_bytes"] is None  # no CUDA: absent, not zero


def test_a_failing_probe_stops_but_the_run_goes_on() -> None:
    class Flaky(CountingProbe):
        def read(self) -> tuple[int, ...]:
            if self.reads == 2:
                raise OSError("driver went away")
            return super().read()

    probe = Flaky()
    tel = Telemetry([probe], {"count": "ok"})
    for step in range(5):
        tel.sample(step, float(step), force=True)
    assert tel.samples["count"].steps == [0, 1]
    assert tel.status["count"] == "failed during the run: OSError: driver went away"
