"""How a published table was measured: one line stating the command, commit, date, machine
and load average before and after, in the same words in every file under
``results/tables/`` (a test reads them all).

Tools that write a table take a :class:`Measurement` before they start and write its
:meth:`~Measurement.line` when they end. A table written by hand from commands' output is
stamped the same way from a shell::

    python -m kvbench.results.provenance start > /tmp/load   # before the commands
    python -m kvbench.results.provenance line --command "CMD" --before "$(cat /tmp/load)"
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import sys
from dataclasses import dataclass, field

from kvbench.results.machine import cpu_model, git_commit

Load = tuple[float, float, float]

# The line's shape, for the test that checks every published table carries one.
LINE = re.compile(
    r"^> Measured at commit (?P<commit>[0-9a-f]{12}(-dirty)?|unknown) on "
    r"(?P<date>\d{4}-\d\d-\d\d \d\d:\d\d) UTC by `(?P<command>[^`]+)`; machine: "
    r"(?P<machine>[^;]+); load average \(1/5/15 min\) (?P<before>[\d.]+ / [\d.]+ / [\d.]+|"
    r"unknown) before, (?P<after>[\d.]+ / [\d.]+ / [\d.]+|unknown) after(?P<clock>\. .*)?$")


def load_now() -> Load | None:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return None
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def load_text(load: Load | None) -> str:
    return "unknown" if load is None else " / ".join(f"{x:.2f}" for x in load)


def parse_load(text: str) -> Load | None:
    """``"0.12 / 0.30 / 0.41"`` (as :func:`load_text` writes it) or ``unknown``."""
    if text.strip() == "unknown":
        return None
    parts = [float(p) for p in text.split("/")]
    if len(parts) != 3:
        raise ValueError(f"{text!r}: give three load averages as 'a / b / c'")
    return (parts[0], parts[1], parts[2])


def machine_text() -> str:
    import importlib.metadata as md

    try:
        torch = md.version("torch")
    except md.PackageNotFoundError:
        torch = "none"
    return (f"{cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"torch {torch}")


@dataclass(slots=True)
class Measurement:
    """A table's measurement: started now, described when :meth:`line` is called."""

    command: str
    before: Load | None = field(default_factory=load_now)
    started: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    def line(self, clock: str = "") -> str:
        """The stamp, with the load as it is now as "after"; ``clock`` adds a sentence on
        which figures the machine and its load could have changed."""
        commit = git_commit()
        short = "unknown" if commit is None else commit[:12] + (
            "-dirty" if commit.endswith("-dirty") else "")
        text = (f"> Measured at commit {short} on {self.started:%Y-%m-%d %H:%M} UTC by "
                f"`{self.command}`; machine: {machine_text()}; load average (1/5/15 min) "
                f"{load_text(self.before)} before, {load_text(load_now())} after")
        return text + (f". {clock}" if clock else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.results.provenance",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("start", help="print the load average now, to pass as --before later")
    line = sub.add_parser("line", help="print the stamp of a table measured since --before")
    line.add_argument("--command", required=True, help="the command that made the figures")
    line.add_argument("--before", required=True, help="what `start` printed")
    line.add_argument("--clock", default="", help="a sentence on what the load could change")
    args = parser.parse_args(argv)
    if args.what == "start":
        print(load_text(load_now()))
        return 0
    try:
        before = parse_load(args.before)
    except ValueError as exc:
        print(f"error: --before {exc}", file=sys.stderr)
        return 2
    print(Measurement(args.command, before).line(args.clock))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
