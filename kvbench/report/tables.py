"""Side-by-side comparison tables of run records (terminal and Markdown), and the one way
commands print rich tables."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from kvbench.report.findings import FINDINGS_TITLE, run_findings
from kvbench.results.metric_table import report_metrics
from kvbench.results.schema import RunRecord


def table_rows(records: Sequence[RunRecord]) -> list[list[str]]:
    rows = [["status", *[r.status for r in records]]]
    for spec in report_metrics():
        rows.append([spec.label, *[spec.format(r.summary.get(spec.name)) for r in records]])
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
    findings = run_findings(records)
    if findings:
        lines += [f"## {FINDINGS_TITLE}", "", *(f"- {f}" for f in findings), ""]
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
