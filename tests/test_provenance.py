"""The stamp every published table carries: command, commit, date, machine, load."""

from __future__ import annotations

from kvbench.results.provenance import LINE, Measurement, main, parse_load


def test_a_stamp_says_how_a_table_was_measured() -> None:
    line = Measurement("kvbench run default", (0.5, 0.25, 0.1)).line("Virtual clock.")
    m = LINE.match(line)
    assert m, line
    assert m["command"] == "kvbench run default" and m["before"] == "0.50 / 0.25 / 0.10"
    assert m["clock"] == ". Virtual clock."


def test_the_command_line_stamps_a_table_written_by_hand(capsys) -> None:
    assert main(["start"]) == 0
    before = capsys.readouterr().out.strip()
    assert parse_load(before) is not None
    assert main(["line", "--command", "kvbench claims -o DIR", "--before", before]) == 0
    assert LINE.match(capsys.readouterr().out.strip())


def test_a_bad_load_is_refused(capsys) -> None:
    assert main(["line", "--command", "x", "--before", "high"]) == 2
    assert "--before" in capsys.readouterr().err
