"""Sweeps: the same suite run at each of several KV budgets and/or block sizes, one run
folder per point, plus a table and a figure across them (concurrency vs budget; latency vs
memory across block sizes, the reports' run-time block-size trade-off, P9)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.report.plots import plot_block_sweep, plot_sweep
from kvbench.results.schema import RunRecord
from kvbench.run.execute import execute_plan
from kvbench.run.harness import OnProgress
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


def parse_block_sizes(text: str) -> list[int]:
    """``8,16,32`` -> the block sizes, validated, in increasing order."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise KvbenchError(f"--block-size needs positive whole numbers, e.g. 8,16,32 (got {text})")
    sizes = [int(p) for p in parts]
    if len(set(sizes)) != len(sizes):
        raise KvbenchError(f"--block-size lists the same size twice: {text}")
    return sorted(sizes)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One run of a sweep: the suite with ``kv_memory`` and/or ``block_size`` set."""

    kv_memory: str | None = None
    block_size: int | None = None

    @property
    def label(self) -> str:
        parts = ([self.kv_memory] if self.kv_memory else []) + (
            [f"block {self.block_size}"] if self.block_size else [])
        return ", ".join(parts)

    @property
    def folder(self) -> str:
        parts = ([f"kv-{self.kv_memory}"] if self.kv_memory else []) + (
            [f"bs-{self.block_size}"] if self.block_size else [])
        return "-".join(parts)


def sweep_points(budgets: Sequence[str] | None, block_sizes: Sequence[int] | None
                 ) -> list[SweepPoint]:
    """Every combination of the budgets and block sizes given (at least one axis)."""
    if not budgets and not block_sizes:
        raise KvbenchError("a sweep needs --kv-memory sizes or --block-size values")
    return [SweepPoint(b, s) for b in (budgets or [None]) for s in (block_sizes or [None])]


@dataclass(slots=True)
class SweepResult:
    records: list[RunRecord] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "point engine: why" per skipped run
    warnings: list[str] = field(default_factory=list)
    block_axis: bool = False


def run_sweep(
    suite: Suite,
    base: Path | None,
    points: Sequence[SweepPoint],
    out_dir: Path,
    command: str,
    on_engine: Callable[[str, str], OnProgress | None] | None = None,
    *,
    force: bool = False,
    repeats: int = 1,
) -> SweepResult:
    """Run ``suite`` at every point into ``out_dir/<point folder>/`` (``kv-<budget>``,
    ``bs-<size>`` or both), each engine ``repeats`` times (records hold medians). An engine
    that can run none of the requests at a point is skipped there (and listed), not fatal."""
    result = SweepResult(block_axis=any(p.block_size for p in points))
    for point in points:
        at = suite.model_copy(deep=True)
        if point.kv_memory is not None:
            at.run.kv_memory = point.kv_memory
        if point.block_size is not None:
            at.run.block_size = point.block_size
        runnable = []
        for name in at.run.engines:
            one = at.model_copy(deep=True)
            one.run.engines = [name]
            try:
                plan_run(one, base, out_dir, command)
            except KvbenchError as exc:
                result.skipped.append(f"{point.label} {name}: {exc}")
            else:
                runnable.append(name)
        if not runnable:
            continue
        at.run.engines = runnable
        plan = plan_run(at, base, out_dir / point.folder, command, force=force,
                        repeats=repeats)
        result.records += execute_plan(
            plan, (lambda name, p=point.label: on_engine(p, name)) if on_engine else None
        )
        result.warnings += plan.warnings
        if any(r.status == "interrupted" for r in result.records):
            break
    if not result.records:
        raise KvbenchError("no engine could run at any point: " + "; ".join(result.skipped))
    write_text_atomic(out_dir / "sweep.md", sweep_markdown(result))
    try:
        plot = plot_block_sweep if result.block_axis else plot_sweep
        plot(result.records, out_dir / "sweep.png")
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


# Summary metrics that are fractions, shown as percentages in sweep and grid tables.
PERCENT_METRICS = frozenset({"mean_kv_utilization", "prefix_hit_rate"})


def summary_cell(key: str, value: object) -> str:
    """One summary metric as a table cell."""
    if value is None:
        return "-"
    if key in PERCENT_METRICS:
        return f"{100 * float(value):.1f}%"  # type: ignore[arg-type]
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


# Columns a block-size sweep adds: what the block size trades.
BLOCK_COLUMNS: list[tuple[str, str]] = [
    ("peak_kv_reserved_bytes", "peak KV reserved"),
    ("kv_waste_pct", "KV waste %"),
    ("median_tpot_ms", "TPOT p50 ms"),
]


def block_size_of(rec: RunRecord) -> int | None:
    """The block size a record's engine ran with (its resolved section's), if it has one."""
    value = rec.engine_config.get("block_size")
    return int(value) if isinstance(value, int) else None


def sweep_header(block_axis: bool) -> list[str]:
    extra = [label for _, label in BLOCK_COLUMNS] if block_axis else []
    return ["engine", "KV budget", *(["block size"] if block_axis else []),
            *[label for _, label in SWEEP_COLUMNS], *extra]


def sweep_rows(records: Sequence[RunRecord], block_axis: bool = False) -> list[list[str]]:
    rows = []
    order = sorted(records, key=lambda r: (r.engine, r.summary.get("kv_capacity_bytes") or 0,
                                           block_size_of(r) or 0))
    for rec in order:
        s = rec.summary
        row = [rec.engine, format_bytes(s.get("kv_capacity_bytes"))]
        if block_axis:
            size = block_size_of(rec)
            row.append("-" if size is None else str(size))
        first = len(row)
        row += [summary_cell(k, s.get(k)) for k, _ in SWEEP_COLUMNS]
        if block_axis:
            row += [format_bytes(s.get(k)) if k.endswith("_bytes") else summary_cell(k, s.get(k))
                    for k, _ in BLOCK_COLUMNS]
        if rec.status != "ok":
            row[first] = f"{rec.status}: {row[first]}"
        rows.append(row)
    return rows


def sweep_markdown(result: SweepResult) -> str:
    first = result.records[0]
    header = sweep_header(result.block_axis)
    lines = [
        f"# kvbench sweep: {first.suite}",
        "",
        f"- command: `{first.command}`",
        f"- workload: {first.workload.name} ({first.workload.num_requests} requests, digest "
        f"`{first.workload.digest}`); model {first.model.get('name')}, device {first.device}, "
        f"clock {first.clock}",
        "",
        "| " + " | ".join(header) + " |",
        "|---|---|" + "---:|" * (len(header) - 2),
    ]
    lines += ["| " + " | ".join(row) + " |"
              for row in sweep_rows(result.records, result.block_axis)]
    if result.skipped:
        lines += ["", "Skipped (nothing fits):", ""] + [f"- {s}" for s in result.skipped]
    return "\n".join(lines) + "\n"
