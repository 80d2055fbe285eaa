"""The prefix-cache oracle: Belady's MIN over a run's block accesses is the best any cache of
that size could do (checked against an exhaustive search), and a run's record sets its hit
rate beside the policy's."""

from __future__ import annotations

import functools
import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from kvbench.engines.kv import oracle
from kvbench.engines.kv.oracle import LOOKUP, MORE, WRITE, BlockTrace, belady
from kvbench.results.metrics import summarize
from kvbench.run.execute import start_and_run
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection

MOONCAKE = Path(__file__).parent / "fixtures" / "mooncake_synthetic_trace_head300.jsonl"


def _best(names: list[int], kinds: list[int], capacity: int) -> int:
    """The most leading-run hits of any cache of ``capacity`` blocks: after each reference it
    may keep any subset of what it held plus, on a write, the block written."""
    n = len(names)

    @functools.cache
    def go(i: int, held: frozenset[int], run: bool) -> int:
        if i == n:
            return 0
        name, kind = names[i], kinds[i]
        hit = 0
        if kind != WRITE:
            run = (run or kind == LOOKUP) and name in held
            hit = int(run)
        pool = sorted(held | {name} if kind == WRITE else held)
        return hit + max(
            go(i + 1, frozenset(keep), run)
            for r in range(min(capacity, len(pool)) + 1)
            for keep in itertools.combinations(pool, r)
        )

    return go(0, frozenset(), False)


def _requests_trace(rng: random.Random, requests: int) -> tuple[list[int], list[int]]:
    """Requests over a binary prefix tree (a block's name fixes every block before it, as a
    chained hash does): each looks up a leading part of its path, then writes its path;
    requests interleave as concurrent ones do."""
    queues = []
    for _ in range(requests):
        path, node = [], 0
        for _ in range(rng.randint(1, 3)):
            node = 2 * node + rng.randint(1, 2)
            path.append(node)
        looked = path[: rng.randint(0, len(path))]
        queues.append(([("lookup", looked)] if looked else []) + [("write", path)])
    names: list[int] = []
    kinds: list[int] = []
    while any(queues):
        what, blocks = rng.choice([q for q in queues if q]).pop(0)
        names += blocks
        first, rest = (LOOKUP, MORE) if what == "lookup" else (WRITE, WRITE)
        kinds += [first] + [rest] * (len(blocks) - 1)
    return names, kinds


def test_min_matches_exhaustive_search() -> None:
    rng = random.Random(7)
    checked = 0
    while checked < 120:
        names, kinds = _requests_trace(rng, rng.randint(1, 4))
        if len(names) > 12:
            continue
        capacity = rng.randint(0, 3)
        got = belady(np.array(names, dtype=np.uint64), np.array(kinds, dtype=np.int8), capacity)
        assert got[0] == _best(names, kinds, capacity), (names, kinds, capacity)
        assert got == oracle._belady_py(names, kinds, capacity)
        checked += 1


def test_c_and_python_agree_on_a_long_trace() -> None:
    if oracle._library() is None:
        pytest.skip("no C compiler: the Python search is the only one")
    rng = random.Random(3)
    names, kinds = _requests_trace(rng, 3000)
    for capacity in (0, 1, 3, 8, 100):
        a = belady(np.array(names, dtype=np.uint64), np.array(kinds, dtype=np.int8), capacity)
        assert a == oracle._belady_py(names, kinds, capacity)
    assert a[0] == a[1] > 0  # room for every block: MIN is the unbounded cache


def test_known_answers() -> None:
    # Written a, b; then lookups of a twice and b once with room for one block: keep a.
    names = [1, 2, 1, 1, 2]
    kinds = [WRITE, WRITE, LOOKUP, LOOKUP, LOOKUP]
    assert belady(np.array(names, dtype=np.uint64), np.array(kinds, dtype=np.int8), 1) == (2, 3)
    # A lookup that misses caches nothing; a run stops at its first miss.
    names, kinds = [5, 5, 6, 6], [LOOKUP, LOOKUP, MORE, WRITE]
    assert belady(np.array(names, dtype=np.uint64), np.array(kinds, dtype=np.int8), 4) == (0, 0)


def test_trace_past_its_limit_reports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oracle, "MAX_REFERENCES", 4)
    trace = BlockTrace()
    trace.write([1, 2, 3])
    assert trace.oracle(8, 16) is not None
    trace.lookup(np.array([1, 2], dtype=np.uint64))
    assert trace.stopped and len(trace) == 0
    assert trace.oracle(8, 16) is None


def _summary(tmp: Path, engine: str, kv_memory: str, waves: int = 1, **run: object) -> dict:
    suite = Suite(
        name="oracle", workload=WorkloadSection(trace="mooncake", path=str(MOONCAKE),
                                                num_requests=60),
        model=ModelSection(preset="qwen2.5-7b"),
        run=RunSection(device="sim:a100-80gb", engines=[engine], kv_memory=kv_memory,
                       max_model_len=32768, **run),
    )
    plan = plan_run(suite, None, tmp, "test")
    r, _ = start_and_run(plan, plan.engines[0][1], None, waves)
    return summarize(r)


@pytest.mark.parametrize("engine", ["paged", "paged-lfu"])
def test_run_records_the_gap_to_optimal(tmp_path: Path, engine: str) -> None:
    s = _summary(tmp_path, engine, "3GiB")
    assert s["kv_evictions"] > 0
    assert 0 < s["prefix_hit_rate"] <= s["oracle_hit_rate"] <= s["unbounded_hit_rate"]
    assert s["hit_rate_vs_oracle"] == pytest.approx(s["prefix_hit_rate"] / s["oracle_hit_rate"])


def test_a_cache_that_never_evicts_is_optimal(tmp_path: Path) -> None:
    s = _summary(tmp_path, "paged", "60GiB")
    assert s["kv_evictions"] == 0
    assert s["prefix_hit_rate"] == s["oracle_hit_rate"] == s["unbounded_hit_rate"]
    assert s["hit_rate_vs_oracle"] == 1.0


def test_no_prefix_cache_no_oracle(tmp_path: Path) -> None:
    s = _summary(tmp_path, "contiguous", "3GiB")
    assert s["oracle_hit_rate"] is None and s["hit_rate_vs_oracle"] is None


def test_a_soak_records_no_oracle(tmp_path: Path) -> None:
    # Its trace would grow with every wave and read as a leak of the process.
    s = _summary(tmp_path, "paged", "3GiB", waves=2)
    assert s["prefix_hit_rate"] > 0 and s["oracle_hit_rate"] is None
