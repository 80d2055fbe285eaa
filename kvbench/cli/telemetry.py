"""The ``soak``, ``sweep`` and ``report`` commands (memory telemetry and figures)."""

# Typer options read best one per line, help text included (as in cli.py).

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvbench.cli.options import (
    RESULTS_PANEL,
    RUN_PANEL,
    command_line,
    console,
    engine_task,
    err_console,
    exit_for,
    interruptible,
    note,
    progress_bar,
    run_flags,
    warn,
)
from kvbench.errors import KvbenchError
from kvbench.results.leaks import DEFAULT_NOISE_BYTES, DEFAULT_NOISE_PCT
from kvbench.run.overrides import RunFlags, resolve_suite

if TYPE_CHECKING:
    from kvbench.results.schema import RunRecord

Out = Annotated[Path | None, typer.Option(help="Output folder (default: runs/<suite>-<command>-<time>).")]
Force = Annotated[bool, typer.Option(help="Replace the records an existing output folder holds.")]


def _default_out(suite: str, what: str) -> Path:
    return Path("runs") / f"{suite}-{what}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    from kvbench.report.tables import print_table

    table = Table(title=Text(title))
    for i, col in enumerate(header):
        table.add_column(Text(col), justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*map(Text, row))  # cells are data, not rich markup
    print_table(console, table)


@run_flags()
def soak(
    suite: Annotated[str | None, typer.Argument(help="Suite TOML file or name (default: the embedded default).")] = None,
    waves: Annotated[int, typer.Option(help="Times the workload is sent through one engine instance.")] = 5,
    noise_pct: Annotated[float, typer.Option(help="RSS/device growth over the soak counts as a leak only above this % of the first wave's reading...")] = DEFAULT_NOISE_PCT,
    noise_mib: Annotated[float, typer.Option(help="...and above this many MiB (KV growth is exact: any counts).")] = DEFAULT_NOISE_BYTES / 2**20,
    out: Out = None,
    force: Force = False,
    *,
    flags: RunFlags,
) -> None:
    """Check for leaks: send the workload in waves through one engine instance.

    Memory must be given back after each wave drains; exits 1 when a leak is found."""
    from kvbench.run.plan import plan_run
    from kvbench.tools.soak import SOAK_HEADER, run_soak, soak_findings, soak_rows

    the_suite, base = resolve_suite(suite, flags)
    plan = plan_run(the_suite, base, out or _default_out(the_suite.name, "soak"),
                    command_line(), force=force)
    warn(plan.warnings)
    note(plan.notes)
    plan.warnings.clear()
    console.print(
        f"[bold]{the_suite.name}[/] soak: {waves} waves of {len(plan.workload)} requests, "
        f"model {plan.preset.name}, device {plan.device.label}, clock {plan.clock}, "
        f"engines {', '.join(n for n, _ in plan.engines)}"
    )
    console.print(f"arrivals: {escape(plan.arrivals)}", highlight=False)
    with interruptible() as interrupts, progress_bar() as progress:

        def on_engine(name: str):
            return engine_task(progress, name, waves * len(plan.workload))

        records = run_soak(plan, waves, noise_pct, int(noise_mib * 2**20), on_engine)
    warn(plan.warnings)
    _print_table(f"{the_suite.name} soak ({plan.device.label}): memory after each drain, first → last wave", SOAK_HEADER, soak_rows(records))
    for finding in soak_findings(records):
        console.print(f"- {finding}", highlight=False)
    console.print(f"records, summary.md and figures written to {plan.out_dir}")
    exit_for(records, interrupts)
    if any(r.soak and r.soak.leak_detected for r in records):
        leaky = ", ".join(r.engine for r in records if r.soak and r.soak.leak_detected)
        err_console.print(f"[red]leak detected:[/] {leaky}")
        raise typer.Exit(1)


@run_flags(exclude=("kv_memory", "block_size"))
def sweep(
    suite: Annotated[str | None, typer.Argument(help="Suite TOML file or name (default: the embedded default).")] = None,
    kv_memory: Annotated[str | None, typer.Option(help="KV budgets to run at, e.g. 4MiB,8MiB,16MiB (default without --block-size: 4MiB,8MiB,16MiB,32MiB; with --grid, one more axis).")] = None,
    block_size: Annotated[str | None, typer.Option(help="Block sizes to run at, e.g. 8,16,32,64,128 (with --kv-memory: every combination; with --grid, one more axis).")] = None,
    repeat: Annotated[int, typer.Option(help="Run every engine N times at each point; records hold medians (measured latencies are noisy).")] = 1,
    grid: Annotated[list[str] | None, typer.Option(help="A grid axis FIELD=V1,V2,... over any suite field (repeatable): run flags (replicas, request_rate, max_num_seqs, ...), engine, or suite paths (cluster.router, engines.NAME.FIELD).")] = None,
    workers: Annotated[int, typer.Option(help="With --grid: points run at once on local processes.")] = 1,
    backend: Annotated[str, typer.Option(help="With --grid: local (processes) | ray (one Ray task per point).")] = "local",
    address: Annotated[str | None, typer.Option(help="With --backend ray: the Ray cluster to join (default: start a local one).")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="With --grid: run a grid of more than 10,000 points.")] = False,
    out: Out = None,
    force: Force = False,
    *,
    flags: RunFlags,
) -> None:
    """Run the suite at each KV budget and/or block size, or at every point of a --grid.

    Shows, per engine, how many requests fit at once and what the block size trades between
    latency and memory. With --grid, points run in parallel."""
    from kvbench.tools.sweep import (
        parse_block_sizes,
        parse_budgets,
        run_sweep,
        sweep_header,
        sweep_points,
        sweep_rows,
    )

    the_suite, base = resolve_suite(suite, flags)
    out_dir = out or _default_out(the_suite.name, "sweep")
    if grid:
        if repeat != 1:
            raise KvbenchError("--repeat runs the points of a KV-budget or block-size sweep; "
                               "a --grid point runs once")
        _grid_sweep(the_suite, base, grid, kv_memory, block_size, workers, backend, address,
                    out_dir, force, yes)
        return
    if workers != 1 or backend != "local" or address is not None:
        raise KvbenchError("--workers, --backend and --address run the points of a --grid")
    if kv_memory is None and block_size is None:
        kv_memory = "4MiB,8MiB,16MiB,32MiB"
    points = sweep_points(parse_budgets(kv_memory) if kv_memory else None,
                          parse_block_sizes(block_size) if block_size else None)
    console.print(
        f"[bold]{the_suite.name}[/] sweep over {'; '.join(p.label for p in points)}: engines "
        f"{', '.join(the_suite.run.engines)}"
    )
    with interruptible() as interrupts, progress_bar() as progress:

        def on_engine(point: str, name: str):
            return engine_task(progress, f"{name} @ {point}", None)

        result = run_sweep(the_suite, base, points, out_dir, command_line(), on_engine,
                           force=force, repeats=repeat)
    warn(result.warnings)
    for skipped in result.skipped:
        err_console.print(f"[yellow]skipped:[/] {escape(skipped)}", highlight=False)
    _print_table(f"{the_suite.name}: sweep", sweep_header(result.block_axis),
                 sweep_rows(result.records, result.block_axis))
    console.print(f"per-point runs, sweep.md and sweep.png written to {out_dir}")
    exit_for(result.records, interrupts)


def _grid_sweep(the_suite, base, grid: list[str], kv_memory: str | None,
                block_size: str | None, workers: int, backend: str, address: str | None,
                out_dir: Path, force: bool, yes: bool) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from kvbench.run.outdir import prepare_out_dir
    from kvbench.tools.grid import (
        check_grid_size,
        grid_header,
        grid_rows,
        local_workers,
        parse_axis,
        rate_knees,
        run_grid,
    )
    from kvbench.tools.sweep import parse_block_sizes, parse_budgets

    if backend not in ("local", "ray"):
        raise KvbenchError(f"--backend {backend!r}: local or ray")
    if address is not None and backend != "ray":
        raise KvbenchError("--address joins a Ray cluster: give --backend ray")
    axes = [parse_axis(g) for g in grid]
    if kv_memory is not None:
        axes.append(parse_axis("kv_memory=" + ",".join(parse_budgets(kv_memory))))
    if block_size is not None:
        sizes = parse_block_sizes(block_size)
        axes.append(parse_axis("block_size=" + ",".join(map(str, sizes))))
    n = check_grid_size(axes, yes)
    if backend == "local":
        workers, capped = local_workers(workers, n)
        note([capped] if capped else [])
    prepare_out_dir(out_dir, force)
    where = f"Ray ({address or 'local'})" if backend == "ray" else f"{workers} local workers"
    console.print(f"[bold]{the_suite.name}[/] grid: {n} points "
                  f"({' x '.join(f'{a.name} {len(a.values)}' for a in axes)}) on {where}")
    with interruptible() as interrupts, progress_bar(
        TextColumn("grid points"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(), unit="points",
    ) as progress:
        task = progress.add_task("grid", total=n, failed=0)
        result = run_grid(
            the_suite, base, axes, out_dir, command_line(), workers=workers,
            backend=backend, address=address,  # type: ignore[arg-type]
            on_point=lambda done, failed: progress.update(task, completed=done, failed=failed),
            yes=yes,
        )
    for p in result.points:
        warn([f"{p.point.label}: {w}" for w in dict.fromkeys(p.warnings)])
    _print_table(f"{the_suite.name}: grid ({result.wall_s:.1f} s)", grid_header(result),
                 grid_rows(result))
    for knee in rate_knees(result):
        console.print(f"- {knee}", highlight=False)
    console.print(f"per-point records and grid.md written to {out_dir}")
    exit_for(result.records, interrupts)


def load_run_dirs(run_dirs: list[Path]) -> tuple[list[RunRecord], list[str]]:
    """Every record in the given folders, and warnings about folders whose run never
    finished (their manifests); a folder without records is searched one level down (a
    sweep's per-budget folders). Other JSON files are passed over; one that cannot be read
    as JSON (a truncated record) is an error naming it, and so is a folder that mixes the
    records of two runs."""
    from kvbench.results.manifest import check_folders
    from kvbench.results.recordset import read_folder_record

    def records_in(d: Path, pattern: str) -> list[tuple[Path, RunRecord]]:
        found = []
        for p in sorted(d.glob(pattern)):
            if p.is_file() and not p.name.startswith(".") and (
                    rec := read_folder_record(p)) is not None:
                found.append((p, rec))
        return found

    found: list[tuple[Path, RunRecord]] = []
    for d in run_dirs:
        if not d.is_dir():
            raise KvbenchError(f"{d}: not a folder of run records")
        here = records_in(d, "*.json") or records_in(d, "*/*.json")
        if not here:
            raise KvbenchError(f"{d}: holds no run records (*.json)")
        found += here
    warnings = check_folders((p, r.run_id, r.engine) for p, r in found)
    return [r for _, r in found], warnings


def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run folders (of run, soak or sweep) holding records.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder for report.md and the figures.")],
) -> None:
    """Tables and figures from existing run records, several runs side by side."""
    from kvbench.report.findings import FINDINGS_TITLE, run_findings
    from kvbench.report.labels import engine_labels
    from kvbench.report.outputs import check_output_dir, write_outputs
    from kvbench.report.plots import plot_soak, plot_sweep, write_plots
    from kvbench.report.tables import machine_lines, markdown_table, table_rows

    check_output_dir(output, "--output")
    records, folder_warnings = load_run_dirs(run_dirs)
    warn(folder_warnings)
    extra = []
    if any(r.soak for r in records):
        extra.append(("soak.png", plot_soak))
    budgets: dict[str, set] = {}
    for r in records:
        budgets.setdefault(r.engine, set()).add(r.summary.get("kv_capacity_bytes"))
    if any(len(b) > 1 for b in budgets.values()):
        extra.append(("sweep.png", plot_sweep))
    written, errors = write_plots(records, output, extra)
    warn(errors)
    names = engine_labels(records)
    named = [r.model_copy(update={"engine": n}) for r, n in zip(records, names, strict=True)]
    lines = ["# kvbench report", "", "Runs: " + ", ".join(f"`{d}`" for d in run_dirs), ""]
    lines += [f"- **warning:** {w}" for w in folder_warnings] + [""] * bool(folder_warnings)
    lines += [markdown_table(named), ""]
    findings = run_findings(named)
    if findings:
        lines += [f"## {FINDINGS_TITLE}", "", *(f"- {f}" for f in findings), ""]
    lines += machine_lines(named)
    lines += [f"![{p.stem}]({p.name})" for p in written]
    write_outputs([(output / "report.md", "\n".join(lines) + "\n", "the report")])
    _print_table("report", ["metric", *names], table_rows(records))
    console.print(f"report.md and {len(written)} figures written to {output}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel=RUN_PANEL)(sweep)
    app.command(rich_help_panel=RUN_PANEL)(soak)
    app.command(rich_help_panel=RESULTS_PANEL)(report)
