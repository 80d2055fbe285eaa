"""The "what this run shows" sentences: each states the records' numbers, and is absent
where the records do not support it."""

from __future__ import annotations

from typing import Any

import pytest
from record_factory import make_record

from kvbench.report.findings import run_findings
from kvbench.results.schema import RequestRow, RunRecord

MIB = 2**20
CONTIGUOUS = {
    "mean_concurrent_requests": 1.9, "max_concurrent_requests": 2, "kv_capacity_bytes": 8 * MIB,
    "kv_waste_pct": 63.5, "kv_internal_waste_pct": 57.3, "kv_reservation_waste_pct": 6.2,
    "duration_s": 56.2, "output_throughput": 102.9, "median_ttft_ms": 26582.8,
    "median_tpot_ms": 15.3, "preemptions": 0,
    "fragmentation_wait_s": 0.0, "fragmentation_wait_steps": 0,
}
EXACT = {
    **CONTIGUOUS, "mean_concurrent_requests": 3.5, "max_concurrent_requests": 6,
    "kv_waste_pct": 15.8, "duration_s": 54.7, "output_throughput": 105.7,
    "fragmentation_wait_s": 23.76, "fragmentation_wait_steps": 900,
    "fragmentation_wait_t_s": 19.04, "fragmentation_wait_free_bytes": 5_505_024,
    "fragmentation_wait_largest_free_bytes": 2_899_968,
    "fragmentation_wait_need_bytes": 2_924_544,
}
PAGED = {
    **CONTIGUOUS, "mean_concurrent_requests": 5.3, "max_concurrent_requests": 8,
    "kv_waste_pct": 1.1, "duration_s": 54.5, "output_throughput": 160.0,
    "median_ttft_ms": 13000.0, "median_tpot_ms": 44.0, "preemptions": 8,
}


def _rec(engine: str, summary: dict[str, Any], arrivals: tuple[float, ...] = (0.0, 0.0),
         **kw: Any) -> RunRecord:
    rows = [RequestRow(id=f"r{i}", arrival_s=a, prompt_tokens=10, output_tokens=10,
                       status="ok") for i, a in enumerate(arrivals)]
    return make_record(engine, summary=summary, **kw).model_copy(update={"requests": rows})


def _run(**changes: dict[str, Any]) -> list[RunRecord]:
    base = {"contiguous": CONTIGUOUS, "contiguous-request": EXACT, "paged": PAGED}
    return [_rec(name, {**summary, **changes.get(name.replace("-", "_"), {})})
            for name, summary in base.items()]


def _about(findings: list[str], start: str) -> str | None:
    return next((f for f in findings if f.startswith(start)), None)


def test_every_sentence_quotes_the_records() -> None:
    assert run_findings(_run()) == [
        "paged ran 2.8× as many requests at once as contiguous in the same 8.0 MiB of KV memory "
        "(on average 5.3 vs 1.9, at most 8 vs 2).",
        "contiguous left 63.5% of the KV memory it reserved unused: 57.3% was room no token "
        "would ever fill and 6.2% was held for tokens not yet computed; paged left 1.1%.",
        # 2899968 and 2924544 bytes both round to 2.8 MiB: two decimals keep them apart.
        "contiguous-request: at t = 19.0 s, 5.25 MiB of KV memory was free but the largest hole "
        "was 2.77 MiB (fragmentation index 0.53), so a request needing 2.79 MiB waited; "
        "requests waited with enough memory free in total for 23.8 s, 43% of its run.",
        "Running requests were preempted when KV memory ran out (paged 8 times): each gave up "
        "its KV and computed it again later.",
        "With every request queued at 0 s, the engines bounded throughput: paged produced 55% "
        "more output tokens/s than contiguous (160.0 vs 102.9), and its median time to first "
        "token was 51% lower (13.0 s vs 26.6 s).",
        "Each of paged's output tokens took 2.9× as long as contiguous's (TPOT p50 44.0 ms vs "
        "15.3 ms) with 2.8× as many requests running, so its output throughput rose 55%.",
    ]


def test_no_as_many_when_concurrency_is_about_the_same() -> None:
    f = run_findings(_run(paged={"mean_concurrent_requests": 2.2},
                          contiguous_request={"mean_concurrent_requests": 2.0}))
    assert _about(f, "paged ran") is None
    assert _about(f, "Each of") is None


def test_no_concurrency_comparison_across_kv_budgets() -> None:
    f = run_findings(_run(paged={"kv_capacity_bytes": 16 * MIB}))
    assert not any("as many requests at once" in s for s in f)
    # Rounded down to whole blocks, the budget is still the same memory.
    f = run_findings(_run(paged={"kv_capacity_bytes": 8 * MIB - 32 * 1024}))
    assert f[0].startswith("paged ran 2.8× as many requests at once as contiguous in the same "
                           "8.0 MiB")


def test_small_waste_is_not_a_finding() -> None:
    f = run_findings(_run(contiguous={"kv_waste_pct": 8.0}, contiguous_request={
        "kv_waste_pct": 5.0}))
    assert not any("reserved unused" in s for s in f)


def test_no_fragmentation_sentence_without_a_wait_or_its_data() -> None:
    assert _about(run_findings(_run(contiguous_request={"fragmentation_wait_s": 0.0})),
                  "contiguous-request:") is None
    # A record from before refusals were logged has none of the metrics.
    old = {k: v for k, v in EXACT.items() if not k.startswith("fragmentation")}
    records = _run()
    records[1] = _rec("contiguous-request", old)
    assert not any("largest hole" in s for s in run_findings(records))


def test_throughput_is_compared_only_when_the_engines_bound_it() -> None:
    # The last request arrived 40 s into runs of about 55 s: the arrivals set the pace.
    records = [_rec(r.engine, r.summary, arrivals=(0.0, 40.0)) for r in _run()]
    f = run_findings(records)
    assert _about(f, "Arrivals, not the engines, bounded throughput: the last request arrived "
                     "at 40.0 s of paged's 54.5 s run") is not None
    assert not any("more output tokens/s" in s for s in f)
    assert _about(f, "Each of") is None
    # Queued by 20 s of the same runs: the engines worked off a queue.
    records = [_rec(r.engine, r.summary, arrivals=(0.0, 20.0)) for r in _run()]
    assert _about(run_findings(records), "With every request queued by 20.0 s") is not None


def test_equal_throughput_says_so() -> None:
    f = run_findings(_run(paged={"output_throughput": 104.0},
                          contiguous_request={"output_throughput": 103.5}))
    assert ("With every request queued at 0 s, the engines bounded throughput, and it was "
            "within 2% across them (102.9 to 104.0 output tokens/s).") in f


def test_tied_engines_are_named_together() -> None:
    f = run_findings(_run(contiguous_request={**PAGED, "fragmentation_wait_s": 0.0}))
    assert f[0].startswith("contiguous-request and paged ran 2.8× as many requests at once as "
                           "contiguous")


def test_records_of_different_runs_or_failures() -> None:
    records = _run()
    records[2] = records[2].model_copy(update={"workload": records[2].workload.model_copy(
        update={"digest": "other"})})
    assert run_findings(records) == []
    records = _run()
    records[2] = records[2].model_copy(update={"status": "failed"})
    f = run_findings(records)
    assert not any(s.startswith("paged") or "paged" in s.split(":")[0] for s in f)
    assert _about(f, "contiguous-request ran 1.8× as many") is not None


@pytest.mark.parametrize(("values", "texts"), [
    ((1.0, 2.0), ["1 B", "2 B"]),
    ((2_899_968.0, 2_924_544.0), ["2.77 MiB", "2.79 MiB"]),
    ((5 * MIB, 2 * MIB, 2 * MIB), ["5.0 MiB", "2.0 MiB", "2.0 MiB"]),
    ((3 * 2**30, 1536 * MIB), ["3.0 GiB", "1.5 GiB"]),
])
def test_sizes_keep_different_values_apart(values: tuple[float, ...], texts: list[str]) -> None:
    from kvbench.report.findings import _sizes

    assert _sizes(*values) == texts


def test_more_requests_at_once_without_more_service_is_no_gain() -> None:
    """More requests in flight because each is served more slowly is not called a win: the
    sentence says the throughput and TTFT that did not improve."""
    f = run_findings(_run(paged={"output_throughput": 101.0, "median_ttft_ms": 30_000.0}))
    text = _about(f, "paged ran")
    assert text is not None and text.endswith(
        ", but that was no gain: its output throughput was 101.0 vs 102.9 tokens/s and its "
        "TTFT p50 30.0 s vs 26.6 s, so requests were held longer, not served more.")
    # Faster service keeps the sentence as it was.
    assert _about(run_findings(_run()), "paged ran").endswith("at most 8 vs 2).")


def test_preemptions_say_what_swap_copied_out() -> None:
    f = run_findings(_run(paged={"offload_swapped_out_bytes": 3 << 30}))
    assert ("Running requests were preempted when KV memory ran out (paged 8 times): each gave "
            "up its KV and computed it again later, or where it fit in the first offload tier, "
            "copied it out and back (paged 3.0 GiB copied out).") in f
