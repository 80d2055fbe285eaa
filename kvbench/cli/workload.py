"""Workload commands: ``workload gen``, ``workload import``, ``workload show``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvbench.cli.options import WORKLOAD_PANEL, console, warn
from kvbench.errors import KvbenchError
from kvbench.report.tables import print_table


def gen(
    output: Annotated[Path, typer.Option("-o", "--output", help="Output .jsonl file.")],
    preset: Annotated[str | None, typer.Argument(help="Workload preset name (or give --spec).")] = None,
    spec: Annotated[Path | None, typer.Option(help="Generator spec file (.toml or .json) instead of a preset.")] = None,
    num_requests: Annotated[int | None, typer.Option(help="Number of requests (default: the preset's or spec's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed.")] = 0,
) -> None:
    """Generate a workload from a preset or a spec file and save it as JSONL."""
    from kvbench.workloads.generator import generate
    from kvbench.workloads.io import save_workload
    from kvbench.workloads.presets import generate_preset
    from kvbench.workloads.specfile import load_spec_file

    if (preset is None) == (spec is None):
        raise KvbenchError("give a preset name or --spec FILE (one of them)")
    if spec is not None:
        wl = generate(load_spec_file(spec), num_requests, seed, name=spec.stem,
                      source=f"spec {spec}")
    else:
        assert preset is not None
        wl = generate_preset(preset, num_requests=num_requests, seed=seed)
    save_workload(wl, output)
    warn(wl.warnings)
    console.print(f"{len(wl)} requests, digest {wl.digest} -> {output}", highlight=False)


def import_(
    kind: Annotated[str, typer.Argument(help="Trace kind: azure | azure-lmm | mooncake | sharegpt.")],
    path: Annotated[Path, typer.Argument(help="Trace file.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output .jsonl file.")],
    limit: Annotated[int | None, typer.Option(help="Import only the first N requests.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for token contents.")] = 0,
    image_rule: Annotated[str | None, typer.Option(help="azure-lmm: token rule and size of every image, RULE[:HxW], e.g. qwen2-vl:448x448 (default llava-1.5).")] = None,
) -> None:
    """Import a real trace into a kvbench workload file."""
    from kvbench.workloads.io import save_workload
    from kvbench.workloads.traces import import_trace

    wl = import_trace(kind, path, limit=limit, seed=seed, image_rule=image_rule)
    save_workload(wl, output)
    warn(wl.warnings)
    console.print(f"{len(wl)} requests, digest {wl.digest} -> {output}", highlight=False)


def show(
    workload: Annotated[str, typer.Argument(help="Preset name, workload .jsonl file or KIND:TRACE_PATH.")],
    num_requests: Annotated[int | None, typer.Option(help="Number of requests (first N of a file or trace).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of a preset or trace.")] = 0,
) -> None:
    """Counts, length percentiles, modality mix and shareable-prefix fraction."""
    from kvbench.workloads.io import load_workload_arg
    from kvbench.workloads.stats import describe

    wl = load_workload_arg(workload, num_requests, seed)
    warn(wl.warnings)
    table = Table(title=f"{wl.name} (digest {wl.digest})", show_header=False)
    for key, value in _flatten(describe(wl)):
        table.add_row(key, value)
    print_table(console, table)


def _flatten(info: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in info.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += _flatten(value, name + ".")
        elif isinstance(value, float):
            rows.append((name, f"{value:.4g}"))
        else:
            rows.append((name, str(value)))
    return rows


def register(app: typer.Typer) -> None:
    workload_app = typer.Typer(no_args_is_help=True, help="Generate, import and inspect workloads.")
    workload_app.command("gen")(gen)
    workload_app.command("import")(import_)
    workload_app.command("show")(show)
    app.add_typer(workload_app, name="workload", rich_help_panel=WORKLOAD_PANEL)
