"""Regression-CI commands: ``compare``, ``baseline save``, ``machine``, ``publish``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from kvbench.cli import alert_flags
from kvbench.cli.options import INSPECT_PANEL, RESULTS_PANEL
from kvbench.errors import KvbenchError

err_console = Console(stderr=True)


def compare(
    new: Annotated[Path | None, typer.Argument(help="New record file or folder (searched recursively: many runs, shards or machines); or --new.")] = None,
    baseline: Annotated[Path | None, typer.Argument(help="Baseline record file or folder, e.g. results/baselines; or --baseline.")] = None,
    baseline_opt: Annotated[Path | None, typer.Option("--baseline", help="The baseline, by name (then NEW may come alone, or as --new).")] = None,
    new_opt: Annotated[Path | None, typer.Option("--new", help="The new records, by name.")] = None,
    thresholds: Annotated[Path | None, typer.Option(help="Thresholds TOML (default: the thresholds built into kvbench).")] = None,
    markdown: Annotated[Path | None, typer.Option(help="Write the Markdown summary here.")] = None,
    junit: Annotated[Path | None, typer.Option(help="Write JUnit XML here.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write every comparison as JSON here.")] = None,
    strict: Annotated[bool, typer.Option(help="Improvements beyond tolerance fail too (refresh the baselines), and so does a run whose speed was not compared (baseline from another machine).")] = False,
    allow_missing: Annotated[bool, typer.Option(help="An engine the baseline has but the new run lacks is skipped instead of failing.")] = False,
    allow_partial: Annotated[bool, typer.Option(help="Accept a pair where fewer than half of the gated metrics and curves could be compared (otherwise unusable, exit 2).")] = False,
    allow_loose: Annotated[bool, typer.Option(help="Accept a --thresholds file that drops or loosens the default gates on completed or failed requests (otherwise exit 2).")] = False,
    alerts: Annotated[str | None, typer.Option(help=alert_flags.COMPARE_HELP)] = None,
) -> None:
    """Gate NEW against BASELINE: exit 0 pass, 1 regression, invalid value, missing engine or fired alert (with --strict also an improvement or a run not compared), 2 unusable input."""
    from kvbench.report.alerts import parse_rules
    from kvbench.report.compare import INPUT_ROW, CompareResult, Row, compare_records
    from kvbench.report.gate_outputs import json_report, junit_xml, markdown_summary
    from kvbench.report.outputs import check_output_file, write_outputs
    from kvbench.report.thresholds import DEFAULT_LABEL, check_relaxations, load_thresholds
    from kvbench.results.manifest import check_folders
    from kvbench.results.recordset import load_records

    new, baseline = _new_and_baseline(new, baseline, new_opt, baseline_opt)
    outputs = [(path, what) for path, what in ((markdown, "--markdown"), (junit, "--junit"),
                                                (json_out, "--json")) if path is not None]
    for path, what in outputs:
        check_output_file(path, what)
    label = str(thresholds) if thresholds is not None else DEFAULT_LABEL
    rules = parse_rules(alerts) if alerts is not None else None
    found = []
    try:
        th = load_thresholds(thresholds)
        relaxed = [] if thresholds is None else check_relaxations(th, thresholds,
                                                                   allow_loose=allow_loose)
        found = load_records([new])
        for warning in check_folders((f.path, f.record.run_id, f.record.engine) for f in found):
            err_console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False,
                              soft_wrap=True)
        result = compare_records(
            found, load_records([baseline]), th, strict=strict, allow_missing=allow_missing,
            allow_partial=allow_partial, thresholds_path=label, relaxed=relaxed,
        )
    except KvbenchError as exc:
        # Still write the reports, so that CI shows why the gate could not judge.
        result = CompareResult(strict=strict, thresholds=label, rows=[
            Row(suite="", engine="", metric=INPUT_ROW, verdict="unusable", detail=str(exc))
        ])
    render = {"--markdown": markdown_summary, "--junit": junit_xml, "--json": json_report}
    texts = {what: render[what](result) for what in render}
    code, section = result.exit_code, ""
    if rules is not None:
        section, texts["--junit"], code = alert_flags.gate_compare(
            [f.record for f in found], rules, texts["--junit"], code)
        texts["--markdown"] += section
    write_outputs([(path, texts[what], what) for path, what in outputs])
    _step_summary(texts["--markdown"])
    summary = markdown_summary(result, details=False) + section
    if sys.stdout.isatty():
        from rich.markdown import Markdown

        Console(soft_wrap=True).print(Markdown(summary))
    else:  # a log or a pipe: the Markdown as it is, to be copied
        typer.echo(summary)
    raise typer.Exit(code)


def _new_and_baseline(new: Path | None, baseline: Path | None, new_opt: Path | None,
                      baseline_opt: Path | None) -> tuple[Path, Path]:
    """NEW and BASELINE by name, the rest by position (new first)."""
    named = {"new": new_opt, "baseline": baseline_opt}
    missing = [k for k, v in named.items() if v is None]
    positional = [p for p in (new, baseline) if p is not None]
    if len(positional) != len(missing):
        raise KvbenchError("compare takes the new records and one baseline: kvbench compare "
                           "NEW BASELINE, or --new NEW --baseline BASELINE (or one of each)")
    named.update(zip(missing, positional, strict=True))
    return named["new"], named["baseline"]  # type: ignore[return-value]


def _step_summary(text: str) -> None:
    """In a GitHub Actions job, the Markdown summary also goes to the job's summary page."""
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")
    except OSError as exc:
        err_console.print(f"[yellow]warning:[/] $GITHUB_STEP_SUMMARY {escape(path)}: "
                          f"{escape(exc.strerror or str(exc))}", highlight=False)


def baseline_save(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run folders or record files.")],
    machine: Annotated[str | None, typer.Option(help="Folder name for wall-clock records (default: `kvbench machine`).")] = None,
    root: Annotated[Path, typer.Option(help="Baselines folder.")] = Path("results/baselines"),
) -> None:
    """Store records as baselines: ROOT/<machine>/<suite>/<engine>.json (virtual clock: any)."""
    from kvbench.report.baselines import save_baselines
    from kvbench.results.recordset import load_records

    for path in save_baselines(load_records(run_dirs), root, machine):
        typer.echo(f"baseline {path}")


def machine(
    as_json: Annotated[bool, typer.Option("--json", help="Print the full machine description too.")] = False,
) -> None:
    """This machine's baseline name: hardware and the versions that change timings."""
    from kvbench.report.baselines import machine_slug
    from kvbench.results.machine import machine_info

    info = machine_info()
    if as_json:
        print(json.dumps({"name": machine_slug(info), **info}, indent=1))
    else:
        print(machine_slug(info))


def publish(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run folders or record files (any number of runs, shards and machines).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output folder.")],
    include_host: Annotated[bool, typer.Option(help="Show hostnames and absolute paths (traces, weights, output folders) as recorded; by default they are left out.")] = False,
    metrics: Annotated[str | None, typer.Option(help="Comma-separated summary metrics as table rows, in order (default: the run tables' rows).")] = None,
    name: Annotated[str | None, typer.Option(help="Name the files NAME.md, NAME.csv, NAME.html (and NAME.png) instead of tables.md, tables.csv, index.html.")] = None,
    figure: Annotated[bool, typer.Option(help="Also draw the tables' metrics as bar charts, one panel per metric (NAME.png or tables.png).")] = False,
    notes: Annotated[Path | None, typer.Option(help="A Markdown file placed under the tables (findings, commands).")] = None,
    allow_noisy: Annotated[bool, typer.Option(help="Publish wall-clock records measured on a noisy machine (their noisy-machine warning is shown on the pages).")] = False,
) -> None:
    """Comparison tables for publication: Markdown, CSV and a self-contained HTML page."""
    from kvbench.fileio import read_text
    from kvbench.report.publish import publish as write_tables
    from kvbench.results.manifest import check_folders
    from kvbench.results.recordset import load_records

    found = load_records(run_dirs)
    for warning in check_folders((f.path, f.record.run_id, f.record.engine) for f in found):
        err_console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False,
                          soft_wrap=True)
    bad = [f for f in found if f.record.status != "ok"]
    for f in bad:
        err_console.print(f"[yellow]warning:[/] {escape(str(f.path))}: {escape(f.record.engine)} "
                          f"ended {f.record.status}", highlight=False, soft_wrap=True)
    rows = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else None
    text = read_text(notes, "notes file") if notes is not None else ""
    for path in write_tables(found, output, include_host=include_host, metrics=rows, name=name,
                             figure=figure, notes=text, allow_noisy=allow_noisy):
        typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel=RESULTS_PANEL)(compare)
    app.command(rich_help_panel=RESULTS_PANEL)(publish)
    app.command(rich_help_panel=INSPECT_PANEL)(machine)
    baseline_app = typer.Typer(no_args_is_help=True, help="Store run records as baselines.")
    baseline_app.command("save")(baseline_save)
    app.add_typer(baseline_app, name="baseline", rich_help_panel=RESULTS_PANEL)
