"""Harness behaviour on failures and interruptions: the record is still produced."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest

from helpers import make_workload, text_request
from kvbench.engines.base import BatchShape, Engine, Finished, KVStats, Stamps, StepReport
from kvbench.results.build import build_record
from kvbench.results.metrics import summarize
from kvbench.results.schema import RequestRows, load_record
from kvbench.run.clocks import WallClock
from kvbench.run.harness import run_engine


class ScriptedEngine(Engine):
    """Finishes one token per request per step; raises ``error`` at step ``fail_at``."""

    name = "scripted"

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.pending: dict[str, int] = {}
        self.started: set[str] = set()
        self.steps = 0
        self.fail_at, self.error = fail_at, error
        self.closed = False

    def add(self, request: Any) -> None:
        self.pending[request.id] = request.output_tokens

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> StepReport:
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise self.error  # type: ignore[misc]
        rep = StepReport(kv=KVStats(capacity_bytes=100, used_bytes=0, reserved_bytes=0,
                                    free_bytes=100, largest_free_bytes=100))
        for rid in list(self.pending):
            rep.tokens[rid] = 1
            if rid not in self.started:
                self.started.add(rid)
                rep.first_token.add(rid)
            self.pending[rid] -= 1
            if self.pending[rid] == 0:
                del self.pending[rid]
                rep.finished.append(Finished(rid))
        rep.batch = BatchShape(num_seqs=len(rep.tokens), decode_tokens=len(rep.tokens))
        rep.num_running = len(self.pending)
        return rep

    def close(self) -> None:
        self.closed = True

    def describe(self) -> dict[str, Any]:
        return {}


def _wl():
    return make_workload([text_request(f"r{i}", 10, 5) for i in range(3)])


@pytest.mark.parametrize(
    ("error", "status"),
    [(RuntimeError("kernel exploded"), "failed"), (KeyboardInterrupt(), "interrupted")],
)
def test_failed_or_interrupted_run_still_writes_record(tmp_path, error, status) -> None:
    engine = ScriptedEngine(fail_at=3, error=error)
    run = run_engine(engine, _wl(), WallClock())
    assert run.status == status
    assert engine.closed
    rec = build_record(run, command="test", suite="t", engine_config={}, model={}, device="cpu")
    path = rec.write(tmp_path / "x.json")
    back = load_record(path)
    assert back.status == status
    assert ("kernel exploded" in back.error) if status == "failed" else "Ctrl-C" in back.error
    assert all(r.status == "unfinished" for r in back.requests)


def test_record_rows_are_made_when_read_and_written_as_one_json(tmp_path, monkeypatch) -> None:
    """A run's request rows are made from its timings a chunk at a time; the record file
    is the JSON of the whole record, as pydantic writes it, and reads back equal."""
    monkeypatch.setattr(RequestRows, "CHUNK", 2)
    run = run_engine(ScriptedEngine(), _wl(), WallClock())
    rec = build_record(run, command="test", suite="t", engine_config={}, model={}, device="cpu")
    assert isinstance(rec.requests, RequestRows) and len(rec.requests) == 3
    assert [r.id for r in rec.requests] == ["r0", "r1", "r2"] == [r.id for r in rec.requests[:]]
    assert rec.requests[-1].output_tokens == 5 and rec.requests[1].status == "ok"
    text = rec.to_json()
    assert text == rec.model_dump_json(indent=1) + "\n"
    assert json.loads(text)["requests"] == rec.model_dump()["requests"]
    back = load_record(rec.write(tmp_path / "x.json"))
    assert back == rec and back.requests == list(rec.requests)
    empty = rec.model_copy(update={"requests": []})
    assert json.loads(empty.to_json())["requests"] == []


def test_ok_run_metrics() -> None:
    run = run_engine(ScriptedEngine(), _wl(), WallClock())
    s = summarize(run)
    assert run.status == "ok"
    assert s["completed"] == 3 and s["total_output_tokens"] == 15
    assert s["median_ttft_ms"] is not None and s["median_tpot_ms"] is not None
    assert s["min_frag_index"] == 1.0
    # An engine that does not report admission refusals: unknown, not zero.
    assert s["kv_wait_s"] is None and s["fragmentation_wait_steps"] is None
    assert s["fragmentation_wait_s"] is None


def test_record_schema_mismatch_is_clear(tmp_path) -> None:
    p = tmp_path / "r.json"
    p.write_text('{"schema_version": 99}')
    with pytest.raises(Exception, match="schema_version 99"):
        load_record(p)


class StampedEngine(Engine):
    """Reports what a served engine would: a send time, a token per step at its own time
    (one ms apart, long before the step ends), a completion at its last token, and ``idle``
    empty steps first, more than the harness allows an engine that computes."""

    name = "stamped"

    def __init__(self, idle: int) -> None:
        self.idle = idle
        self.pending: dict[str, int] = {}
        self.times: dict[str, list[float]] = {}
        self.sent: dict[str, float] = {}

    def add(self, request: Any) -> None:
        self.pending[request.id] = request.output_tokens

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> StepReport:
        rep = StepReport(stamps=Stamps())
        if self.idle:
            self.idle -= 1
            return rep
        t = time.perf_counter() - 0.5  # events that happened between steps
        for k, rid in enumerate(list(self.pending)):
            at = t + 0.001 * k
            self.times.setdefault(rid, []).append(at)
            rep.tokens[rid] = 1
            rep.stamps.tokens[rid] = [at]
            if len(self.times[rid]) == 1:
                rep.first_token.add(rid)
                self.sent[rid] = at - 0.01
                rep.stamps.sent[rid] = self.sent[rid]
            self.pending[rid] -= 1
            if self.pending[rid] == 0:
                del self.pending[rid]
                rep.finished.append(Finished(rid, error="HTTP 503" if rid == "r2" else None))
                rep.stamps.finished[rid] = at
        return rep

    def close(self) -> None:
        """Nothing to release."""

    def describe(self) -> dict[str, Any]:
        return {}


def test_stamped_events_keep_their_own_times_and_idle_steps_are_no_stall() -> None:
    engine = StampedEngine(idle=1500)
    clock = WallClock()
    run = run_engine(engine, _wl(), clock)
    assert run.status == "ok", run.error
    gaps = []
    for rid in ("r0", "r1"):
        t = run.timings[rid]
        expected = [clock.at_perf(x) for x in engine.times[rid]]
        assert t.tokens == len(expected) and t.last_token_s == expected[-1]
        assert t.first_token_s == expected[0] and t.finish_s == expected[-1]
        gaps += np.diff(expected).tolist()
        # Latencies count from the send, which the record keeps as the arrival.
        assert t.request.arrival_s == clock.at_perf(engine.sent[rid])
    failed = run.timings["r2"]
    assert failed.status == "failed" and failed.error == "HTTP 503" and failed.finish_s is None
    # The stamped gaps of completed requests only (the failed one's are dropped).
    assert sorted(run.steps.gaps.samples) == sorted(gaps)
    s = summarize(run)
    assert s["completed"] == 2 and s["failed"] == 1


def test_the_virtual_clock_refuses_wall_stamps() -> None:
    from kvbench.engines.model.presets import get_preset
    from kvbench.engines.sim.costmodel import CostModel
    from kvbench.run.clocks import VirtualClock
    from kvbench.run.devices import parse_device

    device = parse_device("sim:h200")
    clock = VirtualClock(CostModel(get_preset("tiny"), device.hardware, 1))
    run = run_engine(StampedEngine(idle=0), _wl(), clock)
    assert run.status == "failed" and "--clock wall" in run.error
