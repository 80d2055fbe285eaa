"""The ``kvbench`` command line."""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from kvbench.cli import alert_flags, claims, fidelity, regress, scale, telemetry, workload
from kvbench.cli.options import (
    INSPECT_PANEL,
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
from kvbench.report.tables import print_table
from kvbench.run.overrides import RunFlags

# The commands in the order of a newcomer's path: run, look at results, then the rest.
HELP_ORDER = ("run", "sweep", "soak", "compare", "baseline", "report", "publish", "workload",
              "capacity", "calibrate", "fidelity", "claims", "list", "machine")


class _WorkflowGroup(TyperGroup):
    """Lists commands in :data:`HELP_ORDER` (typer lists sub-apps after all commands), so
    that the help's panels come in that order too."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        names = super().list_commands(ctx)
        last = len(HELP_ORDER)
        return sorted(names, key=lambda n: HELP_ORDER.index(n) if n in HELP_ORDER else last)


app = typer.Typer(
    cls=_WorkflowGroup,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Benchmark KV-cache memory management: paged vs contiguous vs vLLM.",
)
claims.register(app)
fidelity.register(app)
regress.register(app)
scale.register(app)
telemetry.register(app)
workload.register(app)


def _print_version(value: bool) -> None:
    if value:
        from kvbench import __version__

        console.print(f"kvbench {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print kvbench's version and exit.")] = False,
) -> None:
    """Options of `kvbench` itself (the help shown is the app's)."""


@app.command(rich_help_panel=RUN_PANEL)
@run_flags()
def run(
    suite: Annotated[str | None, typer.Argument(help="Suite TOML file or name (default: the embedded default).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: runs/<suite>-<time>).")] = None,
    force: Annotated[bool, typer.Option(help="Replace the records an existing --out folder holds.")] = False,
    repeat: Annotated[int | None, typer.Option(help="Rounds of every engine (default: the suite's run.repeat; the default suite's is 3); on the wall clock each round runs the engines in another order. Records hold medians, min-max and each repeat's values.")] = None,
    shard: Annotated[str | None, typer.Option(help="Run only share I/N of the suite's engines (for CI matrices).")] = None,
    alerts: Annotated[str | None, typer.Option(help=alert_flags.RUN_HELP)] = None,
    save_result: Annotated[Path | None, typer.Option(help="Also write FILE.json: the run's command, date, machine and per engine its status and summary metrics (schema 1; no curves or request rows), after the records.")] = None,
    *,
    flags: RunFlags,
) -> None:
    """Run a suite: every engine on the same workload; print and write a comparison.
    With --base-url, a live OpenAI-compatible server, no suite file needed."""
    from kvbench.report.alerts import parse_rules
    from kvbench.report.findings import FINDINGS_TITLE, run_findings
    from kvbench.report.publish import write_run_page
    from kvbench.report.tables import table_rows
    from kvbench.results.recordset import FoundRecord
    from kvbench.results.save_result import check_save_result_path, write_save_result
    from kvbench.run.execute import execute_plan
    from kvbench.run.overrides import resolve_suite
    from kvbench.run.plan import plan_run
    from kvbench.run.sharding import Shard

    rules = parse_rules(alerts) if alerts is not None else None
    if save_result is not None:
        check_save_result_path(save_result)
    the_suite, base = resolve_suite(suite, flags)
    the_shard = Shard.parse(shard) if shard is not None else None
    plan = plan_run(the_suite, base, out, command_line(), repeats=repeat, shard=the_shard,
                    force=force)
    if not plan.engines:
        console.print(f"shard {the_shard} of {the_suite.name} has no engines to run")
        return
    warn(plan.warnings)
    note(plan.notes)
    n_warnings = len(plan.warnings)
    console.print(
        f"[bold]{the_suite.name}[/]: {len(plan.workload)} requests ({plan.workload.name}, "
        f"digest {plan.workload.digest}), model {plan.preset.name}, device {plan.device.label}, "
        f"clock {plan.clock}, engines {', '.join(n for n, _ in plan.engines)}"
    )
    console.print(f"arrivals: {escape(plan.arrivals)}", highlight=False)
    with interruptible() as interrupts, progress_bar() as progress:

        def on_engine(name: str):
            return engine_task(progress, name, len(plan.workload))

        records = execute_plan(plan, on_engine)
    table = Table(title=f"{the_suite.name} ({plan.device.label}, {plan.clock} clock)")
    table.add_column("metric")
    for rec in records:
        table.add_column(rec.engine, justify="right")
    for row in table_rows(records):
        table.add_row(*row)
    print_table(console, table)
    findings = run_findings(records)
    if findings:
        console.print(f"\n[bold]{FINDINGS_TITLE}[/]")
        for sentence in findings:
            console.print(f"- {escape(sentence)}", highlight=False)
        console.print()
    warn(plan.warnings[n_warnings:])
    if rules is not None:
        alert_flags.report_run(records, rules, plan.out_dir)
    console.print(f"records, summary.md and figures written to {plan.out_dir}")
    if save_result is not None:
        console.print(f"result: {write_save_result(save_result, records, plan.command)}")
    try:
        found = [FoundRecord(plan.out_dir / f"{r.engine}.json", r) for r in records]
        console.print(f"all of it on one page: {write_run_page(found, plan.out_dir)}")
    except KvbenchError as exc:
        # The records and figures stand without it.
        warn([f"the run's page was not written: {exc}"])
    exit_for(records, interrupts)


@app.command("list", rich_help_panel=INSPECT_PANEL)
def list_names() -> None:
    """Model presets, GPUs, engines, suites and workload presets."""
    from kvbench.engines.model.presets import get_preset, preset_names
    from kvbench.engines.registry import KINDS, NAMED_ENGINES
    from kvbench.engines.sim.hardware import get_gpu, gpu_names
    from kvbench.run.suite import suite_names
    from kvbench.units import format_bytes
    from kvbench.workloads.presets import preset_names as workload_presets

    t = Table(title="model presets")
    for col in ("name", "params", "layers", "KV layer groups", "kv heads", "head dim", "dtype",
                "KV/token", "context"):
        t.add_column(col)
    for name in preset_names():
        p = get_preset(name)
        params = f"{p.num_params / 1e9:.2f}B" + (
            f" ({p.active_params / 1e9:.2f}B active)" if p.moe else "")
        t.add_row(name, params, str(p.num_layers),
                  " + ".join(g.describe() for g in p.layer_groups), str(p.num_kv_heads),
                  str(p.head_dim), p.dtype, format_bytes(p.kv_bytes_per_token), str(p.max_position))
    print_table(console, t)
    t = Table(title="GPUs (sim:NAME[xTP])")
    for col in ("name", "memory", "HBM GB/s", "dense TFLOPS", "link"):
        t.add_column(col)
    for name in gpu_names():
        g = get_gpu(name)
        t.add_row(name, format_bytes(g.memory_bytes), f"{g.hbm_bytes_per_s / 1e9:.0f}",
                  f"{g.flops_per_s / 1e12:.0f}", f"{g.link} {g.link_bytes_per_s / 1e9:.0f} GB/s")
    print_table(console, t)
    t = Table(title="engine kinds: KV policies of the built-in engine, external engines")
    for col in ("kind", "what it is", "KV manager", "attention layout"):
        t.add_column(col)
    for kind in KINDS.values():
        t.add_row(kind.name, kind.section.summary,
                  kind.manager.__name__ if kind.manager else "(external engine)",
                  kind.layout.__name__ if kind.layout else "-")
    print_table(console, t)
    console.print("named engines (--engines): " + ", ".join(
        f"{name} ({section.label()})" for name, section in NAMED_ENGINES.items()))
    console.print("suites: " + ", ".join(suite_names()))
    console.print("workload presets: " + ", ".join(workload_presets()))


_FILE_SYSTEM_REFUSALS = (errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.EROFS)


def main() -> None:
    try:
        app()
    except KvbenchError as exc:
        err_console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        sys.exit(2)
    except OSError as exc:
        # What the file system refuses wherever kvbench writes (a full disk, a name too
        # long): said plainly; records written before it are kept.
        if exc.errno not in _FILE_SYSTEM_REFUSALS:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        err_console.print(f"[red]error:[/] {escape(exc.strerror or str(exc))}{escape(where)}: "
                          "free space or choose a shorter or writable path, then run again",
                          highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        # Before any work started (a run's own interrupts end inside the command).
        err_console.print("[red]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
