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
    check: Annotated[Path | None, typer.Option(help="A published seed-claims.json: run its studies again at its size and exit 1 where a verdict or figure now differs (rows with wall-clock figures are left out).")] = None,
    max_seconds: Annotated[float | None, typer.Option(help="With --check: only rows whose published study took at most this long (a quick check for CI).")] = None,
) -> None:
    """Run one study per policy (P1-P11) and claim (C1-C26) of the field reports.

    Each verdict is written with its figures, its rule and the commands that reproduce it."""
    from kvbench.tools.claims import parse_only, run_claims

    wanted = parse_only(only)  # bad ids fail before any work
    if check is not None:
        _check(check, output, max_seconds, wanted if only else None)
        return

    def progress(ident: str, row) -> None:
        err_console.print(f"{ident}: {row.verdict} ({row.seconds:.1f} s)", highlight=False)

    rows = run_claims(output, quick=quick, only=only, on_study=progress)
    for row in rows:
        console.print(f"[bold]{row.id}[/] {escape(row.verdict)}: {escape(row.measured)}",
                      highlight=False)
    console.print(f"written: {output / 'seed-claims.md'} and {output / 'seed-claims.json'}")


def _check(published: Path, output: Path, max_seconds: float | None,
           only: list[str] | None) -> None:
    from kvbench.tools.claims.current import check_current

    ids, found = check_current(published, output, max_seconds=max_seconds, only=only)
    for line in found:
        console.print(escape(line), highlight=False, soft_wrap=True)
    if found:
        err_console.print(f"[red]{len(found)} differences[/] between {escape(str(published))} "
                          f"and what the code now computes ({len(ids)} rows checked): "
                          "regenerate the table with `kvbench claims -o DIR` on a quiet machine")
        raise typer.Exit(1)
    console.print(f"{len(ids)} published rows still hold: {', '.join(ids) or 'none checked'}")


def register(app: typer.Typer) -> None:
    app.command("claims", rich_help_panel=PLAN_PANEL)(claims)
