"""The ``claims`` command: a verdict on every policy and claim of the field reports."""

# Typer options read best one per line, help text included (as in cli.py).

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kvbench.cli.options import PLAN_PANEL, console, err_console


def claims(
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder for seed-claims.md, seed-claims.json and the runs behind them.")],
    quick: Annotated[bool, typer.Option(help="Smaller workloads (a few minutes on 2 CPU cores); the verdict rules are the same.")] = False,
    only: Annotated[str | None, typer.Option(help="Only these studies, e.g. C1,C21,P5.")] = None,
) -> None:
    """Run one study per policy (P1-P11) and claim (C1-C26) of the field reports.

    Each verdict is written with its figures, its rule and the commands that reproduce it."""
    from kvbench.tools.claims import parse_only, run_claims

    parse_only(only)  # bad ids fail before any work

    def progress(ident: str, row) -> None:
        err_console.print(f"{ident}: {row.verdict} ({row.seconds:.1f} s)", highlight=False)

    rows = run_claims(output, quick=quick, only=only, on_study=progress)
    for row in rows:
        console.print(f"[bold]{row.id}[/] {escape(row.verdict)}: {escape(row.measured)}",
                      highlight=False)
    console.print(f"written: {output / 'seed-claims.md'} and {output / 'seed-claims.json'}")


def register(app: typer.Typer) -> None:
    app.command("claims", rich_help_panel=PLAN_PANEL)(claims)
