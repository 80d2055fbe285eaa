"""KV-budget sweeps: the same suite run at each of several KV budgets, one run folder per
budget, plus a table and a concurrency-vs-budget figure across them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.report.plots import plot_sweep
from kvbench.results.schema import RunRecord
from kvbench.run.execute import execute_plan
from kvbench.run.plan import plan_run
from kvbench.run.suite import Suite
from kvbench.units import format_bytes, parse_bytes


def parse_budgets(text: str) -> list[str]:
    """``4MiB,8MiB,16MiB`` -> the sizes as written, validated, in increasing order."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise KvbenchError("--kv-memory needs at least one size, e.g. 4MiB,8MiB,16MiB")
    sizes = {p: parse_bytes(p) for p in parts}
    if len(set(sizes.values())) != len(sizes):
        raise KvbenchError(f"--kv-memory lists the same size twice: {text}")
    return sorted(sizes, key=sizes.__getitem__)


@dataclass(slots=True)
class SweepResult:
    records: list[RunRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "budget engine: why" per skipped run
    warnings: list[str] = field(default_factory=list)


def run_sweep(
    suite: Suite,
    base: Path | None,
    budgets: Sequence[str],
    out_dir: Path,
    command: str,
    on_engine: Callable[[str, str], Callable[[int], None] | None] | None = None,
    *,
    force: bool = False,
) -> SweepResult:
    """Run ``suite`` at every budget into ``out_dir/kv-<budget>/``. An engine that can run
    none of the requests at a budget is skipped there (and listed), not fatal."""
    result = SweepResult()
    for budget in budgets:
        at = suite.model_copy(deep=True)
        at.run.kv_memory = budget
        runnable = []
        for name in at.run.engines:
            one = at.model_copy(deep=True)
            one.run.engines = [name]
            try:
                plan_run(one, base, out_dir, command)
            except KvbenchError as exc:
                result.skipped.append(f"{budget} {name}: {exc}")
            else:
                runnable.append(name)
        if not runnable:
            continue
        at.run.engines = runnable
        plan = plan_run(at, base, out_dir / f"kv-{budget}", command, force=force)
        result.records += execute_plan(
            plan, (lambda name, b=budget: on_engine(b, name)) if on_engine else None
        )
        result.warnings += plan.warnings
        if any(r.status == "interrupted" for r in result.records):
            break
    if not result.records:
        raise KvbenchError("no engine could run at any budget: " + "; ".join(result.skipped))
    write_text_atomic(out_dir / "sweep.md", sweep_markdown(result))
    try:
        plot_sweep(result.records, out_dir / "sweep.png")
    except Exception as exc:
        result.warnings.append(f"plot sweep.png failed: {type(exc).__name__}: {exc}")
    return result


SWEEP_COLUMNS: list[tuple[str, str]] = [
    ("completed", "done"),
    ("max_concurrent_requests", "max conc."),
    ("mean_concurrent_requests", "mean conc."),
    ("preemptions", "preempt."),
    ("mean_kv_utilization", "KV util."),
    ("output_throughput", "out tok/s"),
    ("p99_ttft_ms", "TTFT p99 ms"),
]


def _cell(key: str, value: object) -> str:
    if value is None:
        return "-"
    if key == "mean_kv_utilization":
        return f"{100 * float(value):.1f}%"  # type: ignore[arg-type]
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def sweep_rows(records: Sequence[RunRecord]) -> list[list[str]]:
    rows = []
    for rec in sorted(records, key=lambda r: (r.engine, r.summary.get("kv_capacity_bytes") or 0)):
        s = rec.summary
        row = [rec.engine, format_bytes(s.get("kv_capacity_bytes"))]
        row += [_cell(k, s.get(k)) for k, _ in SWEEP_COLUMNS]
        if rec.status != "ok":
            row[2] = f"{rec.status}: {row[2]}"
        rows.append(row)
    return rows


def sweep_markdown(result: SweepResult) -> str:
    first = result.records[0]
    header = ["engine", "KV budget", *[label for _, label in SWEEP_COLUMNS]]
    lines = [
        f"# kvbench sweep: {first.suite}",
        "",
        f"- command: `{first.command}`",
        f"- workload: {first.workload.name} ({first.workload.num_requests} requests, digest "
        f"`{first.workload.digest}`); model {first.model.get('name')}, device {first.device}, "
        f"clock {first.clock}",
        "",
        "| " + " | ".join(header) + " |",
        "|---|---|" + "---:|" * len(SWEEP_COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in sweep_rows(result.records)]
    if result.skipped:
        lines += ["", "Skipped (nothing fits):", ""] + [f"- {s}" for s in result.skipped]
    return "\n".join(lines) + "\n"
