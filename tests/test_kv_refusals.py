"""Admission refusals: the request at the head of the queue that the KV manager refused, the
free memory at that moment, and the fragmentation waits summarised from them."""

from __future__ import annotations

from helpers import make_workload, text_request
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sim.costmodel import CostModel
from kvbench.results.curves import build_curves
from kvbench.results.metrics import summarize
from kvbench.results.runlog import EngineRun
from kvbench.run.clocks import VirtualClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine

PRESET = get_preset("llama-3-8b")
BPT = PRESET.kv_bytes_per_token


def _run(name: str) -> EngineRun:
    """A 100-token cache. Step 1 admits a (40 tokens), b (30) and c (30) and refuses d (50)
    with nothing free; a and c finish in step 1, leaving holes of 40 and 30 tokens around b,
    which decodes through step 10: d, needing 50, waits in steps 2-10 with 70 tokens free."""
    settings = EngineSettings(
        preset=PRESET, device=parse_device("sim:a100-80gb"), kv_bytes=100 * BPT, block_size=10,
        prefix_caching=False, scheduler=SchedulerConfig(100, 8, 1000, True),
    )
    engine = build_engine(engine_config(name, NAMED_ENGINES[name], settings))
    workload = make_workload([
        text_request("a", 39, 1), text_request("b", 20, 10), text_request("c", 29, 1),
        text_request("d", 45, 5),
    ])
    clock = VirtualClock(CostModel(PRESET, settings.device.hardware, settings.device.tp))
    run = run_engine(engine, workload, clock)
    assert run.status == "ok", run.error
    return run


def test_contiguous_refusals_are_logged_as_the_scheduler_saw_them() -> None:
    steps = _run("contiguous-request").steps
    assert steps.kv_refused_bytes[:11] == [50 * BPT] * 10 + [0]
    # Step 1 refused d with the cache full; from step 2 the two holes were free.
    assert steps.kv_refused_free_bytes[:11] == [0] + [70 * BPT] * 9 + [0]
    assert steps.kv_refused_largest_free_bytes[:11] == [0] + [40 * BPT] * 9 + [0]
    assert set(steps.kv_refused_bytes[11:]) == {0}
    # At each step's end the freed holes show, but d was refused before they were freed.
    assert steps.kv_free_bytes[0] == 70 * BPT


def test_fragmentation_waits_are_summarised_from_the_refusals() -> None:
    run = _run("contiguous-request")
    s = summarize(run)
    dt, t = run.steps.dt_s, run.steps.t_s
    assert s["fragmentation_wait_steps"] == 9
    assert s["fragmentation_wait_s"] == sum(dt[1:10])
    assert s["kv_wait_s"] == sum(dt[:10])
    # The worst moment: the first of the equal refusals, at the start of step 2.
    assert s["fragmentation_wait_t_s"] == t[1] - dt[1]
    assert s["fragmentation_wait_free_bytes"] == 70 * BPT
    assert s["fragmentation_wait_largest_free_bytes"] == 40 * BPT
    assert s["fragmentation_wait_need_bytes"] == 50 * BPT
    curve = build_curves(run.steps)["fragmentation_wait_bytes"]
    assert curve[:11] == [0] + [50 * BPT] * 9 + [0]


def test_paged_memory_serves_any_request_that_fits_in_total() -> None:
    run = _run("paged")
    s = summarize(run)
    # d is refused in step 1 only (nothing free), then admitted into any free blocks.
    assert run.steps.kv_refused_bytes[:2] == [50 * BPT, 0]
    assert s["fragmentation_wait_steps"] == 0 and s["fragmentation_wait_s"] == 0
    assert s["kv_wait_s"] == run.steps.dt_s[0]
    assert s["fragmentation_wait_need_bytes"] is None
