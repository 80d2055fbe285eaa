"""Side-by-side comparison tables of run records (terminal and Markdown), and the one way
commands print rich tables."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from kvbench.report.findings import FINDINGS_TITLE, run_findings
from kvbench.results.metric_table import MetricSpec, report_metrics
from kvbench.results.repeats import metric_values
from kvbench.results.schema import RunRecord

# How MetricSpec.format shows a missing value.
EMPTY_CELL = "-"


def table_cell(spec: MetricSpec, record: RunRecord) -> str:
    """A metric's value as tables show it: on the wall clock, a measured value of several
    repeats is their median with the min-max range."""
    text = spec.format(record.summary.get(spec.name))
    values = metric_values(record, spec.name)
    if record.clock == "wall" and spec.kind in ("clock", "timing") and values and len(
            values) > 1 and min(values) != max(values):
        text += f" ({spec.format(min(values))}-{spec.format(max(values))})"
    return text


def table_rows(records: Sequence[RunRecord]) -> list[list[str]]:
    """The run table: status, then each metric some engine has (a row empty for every
    engine tells the reader nothing, e.g. device memory on a CPU run)."""
    rows = [["status", *[r.status for r in records]]]
    for spec in report_metrics():
        cells = [table_cell(spec, r) for r in records]
        if any(c != EMPTY_CELL for c in cells):
            rows.append([spec.label, *cells])
    return rows


def _is_tty(console: Console) -> bool:
    # The file itself: FORCE_COLOR makes rich treat a CI log as a terminal of 80 columns.
    try:
        return console.file.isatty()
    except (AttributeError, ValueError):
        return False


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` whole. A terminal gets it fitted to its width; anything else (CI logs,
    pipes, files) gets it at its natural width, since rich would otherwise fit it to 80
    columns and cut cell text ("contigu…")."""
    if _is_tty(console):
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    wide = Console(file=console.file, width=max(natural, console.width),
                   force_terminal=console.is_terminal, color_system=console.color_system,
                   highlight=False)
    wide.print(table)


def markdown_table(records: Sequence[RunRecord]) -> str:
    header = ["metric", *[r.engine for r in records]]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(records)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(records)]
    return "\n".join(lines)


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if lo == hi else f"{lo:{fmt}}-{hi:{fmt}}"


def machine_load_text(record: RunRecord) -> str:
    """The machine while a wall-clock record's engine ran, over its repeats: 1-minute load
    before and after, steal and I/O wait, CPU seconds; for a virtual-clock record, that the
    load could not change its figures."""
    states = record.machine_state
    if record.clock == "virtual":
        return "none needed: virtual clock, the figures are the same on any machine and load"
    if not states:
        return "-"
    before = [s.load_before[0] for s in states if s.load_before]
    after = [s.load_after[0] for s in states if s.load_after]
    steal = [s.steal_pct for s in states if s.steal_pct is not None]
    iowait = [s.iowait_pct for s in states if s.iowait_pct is not None]
    cpu = [s.user_cpu_s + s.system_cpu_s for s in states]
    parts = [f"1-min load {_span(before, '.2f') if before else '?'} before, "
             f"{_span(after, '.2f') if after else '?'} after on {states[0].cpu_count} CPUs"]
    if steal:
        parts.append(f"steal {_span(steal, '.1f')}%, iowait {_span(iowait, '.1f')}%")
    parts.append(f"{_span(cpu, '.2f')} CPU-s per run ({len(states)} "
                 f"run{'s' if len(states) > 1 else ''})")
    return ", ".join(parts)


def machine_lines(records: Sequence[RunRecord]) -> list[str]:
    """The machine's load per engine, and the warnings the records keep."""
    loaded = [r for r in records if r.machine_state]
    out = [f"- {r.engine}: {machine_load_text(r)}" for r in loaded]
    warnings = list(dict.fromkeys(w for r in records for w in r.warnings))
    out += [f"- **warning:** {w}" for w in warnings]
    return ["## The machine while the engines ran", "", *out, ""] if out else []


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
        f"- date: {first.created_utc}",
        "",
        markdown_table(records),
        "",
    ]
    findings = run_findings(records)
    if findings:
        lines += [f"## {FINDINGS_TITLE}", "", *(f"- {f}" for f in findings), ""]
    lines += machine_lines(records)
    lines += quality_lines(records)
    for r in records:
        if r.error:
            lines += [f"**{r.engine} {r.status}:** {r.error.splitlines()[0]}", ""]
    return "\n".join(lines)


def quality_lines(records: Sequence[RunRecord]) -> list[str]:
    """Whether each engine storing KV below the model's dtype had its outputs compared with
    full precision: against what, with which weights, or why not."""
    out = []
    for r in records:
        q = r.quality
        if q is None or not q.below_full_precision:
            continue
        below = ", ".join(f"{m} {d}" for m, d in q.below_full_precision.items())
        if q.ran:
            out.append(f"- {r.engine} ({below}): compared with {q.reference}; weights "
                       f"{q.weights}; probe: {q.probe}")
        else:
            out.append(f"- {r.engine} ({below}): not compared: {q.reason}")
    return ["## Output agreement with full-precision KV", "", *out, ""] if out else []
