"""Progress outside a terminal (CI logs): plain lines while an engine runs and when it ends,
driven by the engines' progress callbacks, in-process and from an engine's own process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_main import cli
from rich.progress import Progress

from kvbench.cli.options import PROGRESS_EVERY_ENV, PlainProgress, progress_bar

SIM = r"(, (?P<sim>[\d,]+\.\d) s simulated)?"
LINE = re.compile(rf"^(?P<task>.+): (?P<done>\d+)/(?P<total>\d+) requests done{SIM}, "
                  r"(?P<elapsed>\d+) s elapsed$")
END = re.compile(rf"^(?P<task>.+): ended, (?P<done>\d+)/(?P<total>\d+) requests done{SIM} "
                 r"in (?P<elapsed>\d+) s$")


class Clock:
    """Wall seconds that a test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_a_line_every_interval_and_one_when_the_engine_ends(capsys) -> None:
    clock = Clock()
    with PlainProgress(10.0, clock=clock) as progress:
        task = progress.add_task("paged", total=24)
        for done, now in [(1, 3.0), (2, 9.9), (3, 10.0), (4, 15.0), (4, 20.5), (24, 31.0)]:
            clock.now = now
            progress.update(task, completed=done)
        progress.update(task, completed=24)  # after its end: nothing more
    assert _lines(capsys.readouterr().err) == [
        "paged: 3/24 requests done, 10 s elapsed",
        "paged: 4/24 requests done, 20 s elapsed",
        "paged: ended, 24/24 requests done in 31 s",
    ]


def test_an_engine_that_stops_short_ends_when_the_next_starts_or_the_work_ends(capsys) -> None:
    clock = Clock()
    with PlainProgress(10.0, clock=clock) as progress:
        first = progress.add_task("paged", total=10)
        clock.now = 4.0
        progress.update(first, completed=6)
        clock.now = 50.0  # the record is written; the next engine starts
        second = progress.add_task("contiguous", total=10)
        clock.now = 52.0
        progress.update(second, completed=2)
    assert _lines(capsys.readouterr().err) == [
        "paged: ended, 6/10 requests done in 4 s",
        "contiguous: ended, 2/10 requests done in 2 s",
    ]


def test_a_task_without_a_total_and_extra_fields(capsys) -> None:
    clock = Clock()
    with PlainProgress(0.0, unit="points", clock=clock) as progress:
        task = progress.add_task("grid", total=None, failed=0)
        clock.now = 1.0
        progress.update(task, completed=1, failed=1)
    assert _lines(capsys.readouterr().err) == [
        "grid: 1 points done, 1 failed, 1 s elapsed",
        "grid: ended, 1 points done, 1 failed in 1 s",
    ]


def test_a_terminal_keeps_the_live_bar(monkeypatch) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # how rich is told the stream is a terminal
    assert isinstance(progress_bar(), Progress)
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    assert isinstance(progress_bar(), PlainProgress)


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_a_bad_interval_is_refused(value: str, capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PROGRESS_EVERY_ENV, value)
    code, out = cli(capsys, monkeypatch)("run", "quick-sim", "--num-requests", "2",
                                         "--repeat", "1", "--out", tmp_path / "o")
    assert code == 2
    assert f"{PROGRESS_EVERY_ENV}={value}: give the seconds between progress lines" in out


def _run_lines(out: str, engine: str) -> tuple[list[re.Match], list[re.Match]]:
    lines = _lines(out)
    during = [m for line in lines if (m := LINE.match(line)) and m["task"] == engine]
    ends = [m for line in lines if (m := END.match(line)) and m["task"] == engine]
    return during, ends


def test_run_prints_plain_lines_in_a_log(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0")  # a line at every update
    code, out = cli(capsys, monkeypatch)(
        "run", "quick-sim", "--num-requests", "6", "--engines", "paged,contiguous",
        "--repeat", "1", "--no-fast-forward", "--out", tmp_path / "o")
    assert code == 0, out
    for engine in ("paged", "contiguous"):
        during, ends = _run_lines(out, engine)
        assert during and all(m["total"] == "6" for m in during), out
        counts = [int(m["done"]) for m in during]
        assert counts == sorted(counts) and counts[-1] <= 6
        assert [(m["done"], m["total"]) for m in ends] == [("6", "6")]
        # The virtual clock's seconds go with each line: they only grow, and the run's
        # last line gives the simulated time its requests took.
        sims = [float(m["sim"].replace(",", "")) for m in during + ends]
        assert sims == sorted(sims) and sims[-1] > 0, out


def test_an_engine_in_its_own_process_drives_the_lines(capsys, monkeypatch,
                                                       tmp_path: Path) -> None:
    """On the wall clock each engine runs in a child process; its progress reaches the
    parent's lines through the callbacks."""
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0")
    code, out = cli(capsys, monkeypatch)(
        "run", "quick-cpu", "--num-requests", "3", "--engines", "paged", "--repeat", "1",
        "--kv-memory", "1MiB", "--max-model-len", "512", "--out", tmp_path / "o")
    assert code == 0, out
    during, ends = _run_lines(out, "paged")
    assert [(m["done"], m["total"]) for m in ends] == [("3", "3")], out
    assert all(m["total"] == "3" for m in during)
    assert all(m["sim"] is None for m in during + ends)  # the wall clock: elapsed says it
