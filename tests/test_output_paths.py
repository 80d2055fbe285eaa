"""Output paths of compare, publish, report and baseline save: checked before anything is
written, with a message naming the option and the path."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_main import cli
from record_factory import make_record, write


@pytest.fixture
def kvbench(capsys, monkeypatch):
    return cli(capsys, monkeypatch)


def _clean(out: str) -> None:
    assert "Traceback" not in out, out


def test_compare_output_that_is_a_folder_writes_nothing(kvbench, tmp_path: Path) -> None:
    path = write(make_record(), tmp_path / "run")
    (tmp_path / "reports").mkdir()
    code, out = kvbench("compare", path, path, "--junit", tmp_path / "junit.xml",
                        "--markdown", tmp_path / "reports")
    _clean(out)
    assert code == 2 and "--markdown" in out and "is a folder; name a file" in out
    assert not (tmp_path / "junit.xml").exists()


def test_compare_outputs_must_differ(kvbench, tmp_path: Path) -> None:
    path = write(make_record(), tmp_path / "run")
    same = tmp_path / "out.txt"
    code, out = kvbench("compare", path, path, "--junit", same, "--json", same)
    _clean(out)
    assert code == 2 and "--junit and --json both name" in out and not same.exists()


@pytest.mark.parametrize("command", ["compare", "publish", "report", "baseline save"])
def test_output_below_a_file(kvbench, tmp_path: Path, command: str) -> None:
    run = tmp_path / "run"
    write(make_record(), run)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    target = blocker / "sub"
    args = {"compare": ["compare", run, run, "--markdown", target / "c.md"],
            "publish": ["publish", run, "-o", target],
            "report": ["report", run, "-o", target],
            "baseline save": ["baseline", "save", run, "--root", target]}[command]
    code, out = kvbench(*args)
    _clean(out)
    assert code == 2, out
    assert f"{blocker} is a file, not a folder" in out


@pytest.mark.parametrize("command", ["publish", "report", "baseline save"])
def test_output_folder_that_is_a_file(kvbench, tmp_path: Path, command: str) -> None:
    run = tmp_path / "run"
    write(make_record(), run)
    target = tmp_path / "taken"
    target.write_text("keep me")
    args = {"publish": ["publish", run, "-o", target], "report": ["report", run, "-o", target],
            "baseline save": ["baseline", "save", run, "--root", target]}[command]
    code, out = kvbench(*args)
    _clean(out)
    assert code == 2 and f"{target} is a file; name a folder" in out
    assert target.read_text() == "keep me"
