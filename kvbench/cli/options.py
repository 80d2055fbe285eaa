"""What the commands share: the consoles, the run flags (declared once, on
:class:`kvbench.run.overrides.RunFlags`), progress bars and the interrupt handling of
run-shaped commands."""

from __future__ import annotations

import functools
import inspect
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Annotated, Any, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

from kvbench.errors import KvbenchError
from kvbench.run.overrides import RunFlags, flag_name
from kvbench.run.signals import Interrupts, sigterm_interrupts

# The panels of `kvbench --help`, one per workflow.
RUN_PANEL = "Run benchmarks"
RESULTS_PANEL = "Compare, gate and publish results"
WORKLOAD_PANEL = "Workloads"
PLAN_PANEL = "Plan capacity, calibrate, check claims"
INSPECT_PANEL = "Presets and this machine"

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


# Seconds between the plain progress lines of one task; the environment may set another
# interval (a CI log that wants more or fewer lines; tests).
PROGRESS_EVERY_ENV = "KVBENCH_PROGRESS_EVERY_S"
PROGRESS_EVERY_S = 10.0


def progress_bar(*columns: ProgressColumn, unit: str = "requests") -> Progress | PlainProgress:
    """A live bar on a terminal; elsewhere (a CI log) plain lines, which a log keeps:
    :class:`PlainProgress`, driven by the same ``add_task``/``update`` calls."""
    if err_console.is_terminal:
        columns = columns or (TextColumn("{task.description}"), BarColumn(),
                              MofNCompleteColumn(), TimeElapsedColumn())
        return Progress(*columns, console=err_console, transient=True)
    text = os.environ.get(PROGRESS_EVERY_ENV)
    try:
        every_s = PROGRESS_EVERY_S if text is None else float(text)
    except ValueError:
        every_s = -1.0
    if not 0 <= every_s < math.inf:
        raise KvbenchError(f"{PROGRESS_EVERY_ENV}={text}: give the seconds between progress "
                           f"lines, a number >= 0 (default {PROGRESS_EVERY_S:g})")
    return PlainProgress(every_s, unit)


def engine_task(progress: Progress | PlainProgress, description: str,
                total: float | None) -> Callable[[int, float | None], None]:
    """A task on ``progress`` and the callback an engine's run updates it by
    (:data:`kvbench.run.harness.OnProgress`): requests done, and on the virtual clock the
    simulated seconds, which a log then shows beside the wall seconds."""
    task = progress.add_task(description, total=total)

    def update(done: int, sim_s: float | None) -> None:
        if sim_s is None:
            progress.update(task, completed=done)
        else:
            progress.update(task, completed=done, simulated=f"{sim_s:,.1f} s")

    return update


@dataclass(slots=True)
class _Task:
    description: str
    total: float | None
    started_s: float
    fields: dict[str, Any]
    completed: float = 0
    updated_s: float = 0
    said_s: float = 0
    ended: bool = False


class PlainProgress:
    """Progress as plain lines for logs. A task says where it is at an update when
    ``every_s`` have passed since it last did, and says so once more when it ends: at its
    total, when a later task starts, or when the work ends. Only updates drive it (no timer),
    so an engine in a child process is reported through the callbacks that relay its
    progress; ``clock`` gives wall seconds."""

    def __init__(self, every_s: float, unit: str = "requests",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.unit, self.clock = every_s, unit, clock
        self.tasks: list[_Task] = []

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        for task in self.tasks:
            self._end(task)

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        for task in self.tasks:  # one task at a time: a new one means the last ended
            self._end(task)
        now = self.clock()
        self.tasks.append(_Task(description, total, now, fields, updated_s=now, said_s=now))
        return len(self.tasks) - 1

    def update(self, task_id: int, *, completed: float | None = None,
               total: float | None = None, **fields: Any) -> None:
        task = self.tasks[task_id]
        if task.ended:
            return
        task.completed = task.completed if completed is None else completed
        task.total = task.total if total is None else total
        task.fields.update(fields)
        task.updated_s = self.clock()
        if task.total is not None and task.completed >= task.total:
            self._end(task)
        elif task.updated_s - task.said_s >= self.every_s:
            task.said_s = task.updated_s
            self._say(task, f"{self._count(task)}, {task.updated_s - task.started_s:.0f} s "
                            "elapsed")

    def _end(self, task: _Task) -> None:
        if not task.ended:
            task.ended = True
            self._say(task, f"ended, {self._count(task)} in "
                            f"{task.updated_s - task.started_s:.0f} s")

    def _count(self, task: _Task) -> str:
        of = "" if task.total is None else f"/{task.total:g}"
        extra = "".join(f", {v} {k}" for k, v in task.fields.items())
        return f"{task.completed:g}{of} {self.unit} done{extra}"

    def _say(self, task: _Task, what: str) -> None:
        err_console.print(f"{task.description}: {what}", markup=False, highlight=False)


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
