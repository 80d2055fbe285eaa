"""A new KV policy is cheap: a paged variant defined here, registered for the test alone, is
listed, runs, and takes the fast path its base class earned, without touching another
file. One that changes a per-step hook runs step by step and its record says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.engines.config import EngineConfig
from kvbench.engines.kv.paged import PagedKVManager, PagedPolicy
from kvbench.engines.registry import KINDS, NAMED_ENGINES, Kind
from kvbench.engines.sequence import Sequence
from kvbench.kernels.layouts import BlockTables
from kvbench.run.execute import record_of, start_and_run
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection


class TaggedPagedKVManager(PagedKVManager):
    """Paged blocks whose description carries a tag: nothing a step does changes."""

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tag": "variant"}


class GreedyPagedKVManager(PagedKVManager):
    """Paged blocks that count each grow: a per-step hook of its own."""

    grows = 0

    def grow(self, seq: Sequence, num_new: int) -> bool:
        type(self).grows += 1
        return super().grow(seq, num_new)


class TaggedPolicy(PagedPolicy):
    kind: Literal["paged-tagged"] = "paged-tagged"
    summary = "paged, its description tagged"

    def manager(self, config: EngineConfig) -> PagedKVManager:
        return _build(TaggedPagedKVManager, config)


class GreedyPolicy(PagedPolicy):
    kind: Literal["paged-greedy"] = "paged-greedy"
    summary = "paged, counting grows"

    def manager(self, config: EngineConfig) -> PagedKVManager:
        return _build(GreedyPagedKVManager, config)


def _build(manager: type[PagedKVManager], config: EngineConfig) -> PagedKVManager:
    return manager(config.num_pages, config.kv.page_tokens, config.kv.bytes_per_token,
                   config.scheduler.max_model_len, enable_prefix_caching=config.prefix_caching,
                   dtype=config.kv.dtype)


@pytest.fixture
def variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry entries of both variants, for the test alone."""
    for policy, manager in ((TaggedPolicy, TaggedPagedKVManager),
                            (GreedyPolicy, GreedyPagedKVManager)):
        kind = Kind(policy, manager, BlockTables)
        monkeypatch.setitem(KINDS, kind.name, kind)
        monkeypatch.setitem(NAMED_ENGINES, kind.name, policy())


def _records(tmp: Path, workload: WorkloadSection, engines: list[str]) -> dict[str, dict]:
    suite = Suite(name="variant", workload=workload, model=ModelSection(preset="llama-2-7b"),
                  run=RunSection(device="sim:a100-80gb", engines=engines, kv_memory="3GiB"))
    plan = plan_run(suite, None, tmp, "test")
    out = {}
    for name, config in plan.engines:
        run, described = start_and_run(plan, config, None)
        out[name] = record_of(plan, run, described).model_dump()
    return out


def test_the_variant_is_listed(variants: None) -> None:
    result = CliRunner().invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    assert "paged-tagged" in result.output and "TaggedPagedKVManager" in result.output


@pytest.mark.parametrize(("preset", "steps"), [
    ("mixed-text", "replayed by events"),
    ("parallel-sampling", "decode runs in one go"),  # n > 1: no event replay
])
def test_the_variant_runs_on_the_fast_path(variants: None, tmp_path: Path, preset: str,
                                            steps: str) -> None:
    workload = WorkloadSection(preset=preset, num_requests=16, seed=1)
    records = _records(tmp_path, workload, ["paged", "paged-tagged"])
    paged, tagged = records["paged"], records["paged-tagged"]
    assert tagged["status"] == "ok" and tagged["summary"]["completed"] == 16
    assert tagged["engine_config"]["kv_manager"]["tag"] == "variant"
    assert tagged["engine_config"]["fast_forward"]["mode"] == "on"
    assert tagged["engine_config"]["fast_forward"]["steps"] > 0, steps
    # Same blocks, same decisions: the same run as paged's.
    assert tagged["requests"] == paged["requests"]
    host = {"wall_time_s", "peak_rss_bytes", "rss_growth_pct", "telemetry_overhead_pct"}
    assert ({k: v for k, v in tagged["summary"].items() if k not in host}
            == {k: v for k, v in paged["summary"].items() if k not in host})


def test_a_variant_with_a_step_hook_says_why_it_steps(variants: None, tmp_path: Path) -> None:
    GreedyPagedKVManager.grows = 0
    workload = WorkloadSection(preset="parallel-sampling", num_requests=8, seed=1)
    record = _records(tmp_path, workload, ["paged-greedy"])["paged-greedy"]
    assert record["status"] == "ok"
    assert record["engine_config"]["fast_forward"] == {
        "mode": "unsupported: the GreedyPagedKVManager policy advances step by step: it "
                "overrides grow of PagedKVManager but not its decode_room",
        "steps": 0,
    }
    assert GreedyPagedKVManager.grows > 0
