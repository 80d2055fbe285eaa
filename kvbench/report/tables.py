"""Side-by-side comparison tables of run records (terminal and Markdown)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvbench.results.schema import RunRecord
from kvbench.units import format_bytes


def _num(fmt: str) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else format(v, fmt)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


# (summary key, label, formatter)
TABLE_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("completed", "completed requests", _num("d")),
    ("rejected", "rejected requests", _num("d")),
    ("duration_s", "duration (s)", _num(".2f")),
    ("request_throughput", "requests/s", _num(".2f")),
    ("output_throughput", "output tokens/s", _num(".1f")),
    ("total_token_throughput", "total tokens/s", _num(".1f")),
    ("median_ttft_ms", "TTFT p50 (ms)", _num(".1f")),
    ("p99_ttft_ms", "TTFT p99 (ms)", _num(".1f")),
    ("median_tpot_ms", "TPOT p50 (ms)", _num(".2f")),
    ("p99_tpot_ms", "TPOT p99 (ms)", _num(".2f")),
    ("median_e2el_ms", "E2EL p50 (ms)", _num(".1f")),
    ("max_concurrent_requests", "max concurrent requests", _num("d")),
    ("mean_concurrent_requests", "mean concurrent requests", _num(".1f")),
    ("kv_capacity_bytes", "KV capacity", format_bytes),
    ("peak_kv_reserved_bytes", "peak KV reserved", format_bytes),
    ("peak_kv_used_bytes", "peak KV used", format_bytes),
    ("mean_kv_utilization", "KV utilization (used/reserved)", _pct),
    ("kv_waste_pct", "KV waste %", _num(".1f")),
    ("min_frag_index", "min fragmentation index", _num(".3f")),
    ("preemptions", "preemptions", _num("d")),
    ("prefix_hit_rate", "prefix cache hit rate", _pct),
    ("peak_rss_bytes", "peak process RSS", format_bytes),
]


def table_rows(records: Sequence[RunRecord]) -> list[list[str]]:
    rows = [["status", *[r.status for r in records]]]
    for key, label, fmt in TABLE_ROWS:
        rows.append([label, *[fmt(r.summary.get(key)) for r in records]])
    return rows


def markdown_table(records: Sequence[RunRecord]) -> str:
    header = ["metric", *[r.engine for r in records]]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(records)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(records)]
    return "\n".join(lines)


def summary_markdown(records: Sequence[RunRecord]) -> str:
    first = records[0]
    wl = first.workload
    machine = first.machine
    lines = [
        f"# kvbench run: {first.suite}",
        "",
        f"- command: `{first.command}`",
        f"- workload: {wl.name} ({wl.num_requests} requests, {wl.prompt_tokens} prompt / "
        f"{wl.output_tokens} output tokens, digest `{wl.digest}`, source {wl.source})",
        f"- model: {first.model.get('name')} ({first.model.get('dtype')}), "
        f"device {first.device}, clock {first.clock}",
        f"- machine: {machine.get('cpu')} x{machine.get('cpu_count')}"
        + (f", GPU {machine['gpu']['name']}" if machine.get("gpu") else "")
        + f"; kvbench {first.kvbench_version} ({first.git_commit or 'no git'})",
        "",
        markdown_table(records),
        "",
    ]
    for r in records:
        if r.error:
            lines += [f"**{r.engine} {r.status}:** {r.error.splitlines()[0]}", ""]
    return "\n".join(lines)
