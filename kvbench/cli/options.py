"""What the commands share: the consoles, the run flags (declared once, on
:class:`kvbench.run.overrides.RunFlags`), progress bars and the interrupt handling of
run-shaped commands."""

from __future__ import annotations

import functools
import inspect
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvbench.run.overrides import RunFlags, flag_name
from kvbench.run.signals import Interrupts, sigterm_interrupts

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

_FLAG_TYPES = {f.name: t for f, t in zip(fields(RunFlags), get_type_hints(RunFlags).values(),
                                            strict=True)}


def _option(name: str) -> Any:
    f = next(f for f in fields(RunFlags) if f.name == name)
    decls = f.metadata["decls"] or (flag_name(name),)
    return Annotated[_FLAG_TYPES[name], typer.Option(*decls, help=f.metadata["help"])]


def run_flags(*, exclude: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command every run flag (but ``exclude``), passed to it as ``flags: RunFlags``.

    The command declares its own parameters plus ``flags``; the flags' options are appended
    to its signature, so every run-shaped command takes the same flags with the same help.
    """
    names = [f.name for f in fields(RunFlags) if f.name not in exclude]

    def wrap(command: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(command)
        hints = get_type_hints(command, include_extras=True)
        own = [p.replace(annotation=hints[p.name]) for p in sig.parameters.values()
               if p.name != "flags"]
        added = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation=_option(n))
            for n in names
        ]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            flags = RunFlags(**{n: kwargs.pop(n) for n in names})
            return command(flags=flags, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in [*own, *added]}
        del wrapper.__wrapped__  # typer must read the new signature, not the command's
        return wrapper

    return wrap


def command_line() -> str:
    return "kvbench " + shlex.join(sys.argv[1:])


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=True,
    )


def warn(messages: list[str]) -> None:
    for msg in messages:
        err_console.print(f"[yellow]warning:[/] {escape(msg)}", highlight=False)


def note(messages: list[str]) -> None:
    for msg in messages:
        err_console.print(f"note: {escape(msg)}", highlight=False)


@contextmanager
def interruptible() -> Iterator[Interrupts]:
    """Run a command's work with SIGTERM handled like Ctrl-C; an interrupt that escapes the
    work (records already written by it) ends the command with 130 or 143."""
    try:
        with sigterm_interrupts() as state:
            yield state
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/]")
        raise typer.Exit(state.exit_status) from None


def exit_for(records: list, interrupts: Interrupts) -> None:
    """Report engines that did not finish and exit accordingly: 143 (SIGTERM) or 130
    (Ctrl-C) when interrupted, 1 when an engine failed."""
    for rec in records:
        if rec.error:
            first = escape(rec.error.splitlines()[0])
            err_console.print(f"[red]{rec.engine} {rec.status}:[/] {first}", highlight=False)
    if any(r.status == "interrupted" for r in records):
        raise typer.Exit(interrupts.exit_status)
    if any(r.status != "ok" for r in records):
        raise typer.Exit(1)
