"""Names that become paths when a record is stored as a baseline: only plain names, so
nothing is ever written outside the baselines folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_main import cli
from record_factory import make_record, write

from kvbench.errors import KvbenchError
from kvbench.results.paths import check_path_component


@pytest.fixture
def kvbench(capsys, monkeypatch):
    return cli(capsys, monkeypatch)


def _clean(out: str) -> None:
    assert "Traceback" not in out, out


@pytest.mark.parametrize(
    ("field", "value"),
    [("suite", "../../../../x"), ("engine", "../../eng"), ("suite", "a/b"), ("engine", ".."),
     ("suite", "."), ("engine", ".hidden"), ("suite", ""), ("engine", "two words"),
     ("suite", "/abs"), ("engine", "nul\x00")],
)
def test_baseline_save_refuses_names_that_leave_the_folder(
    kvbench, tmp_path: Path, field: str, value: str
) -> None:
    run = tmp_path / "deep" / "er" / "run"
    write(make_record("contiguous"), run)  # a good record: not written either
    write(make_record(**{field: value}) if field == "suite" else
          make_record(value), run, "bad")
    root = tmp_path / "deep" / "er" / "results" / "baselines"
    before = {p for p in tmp_path.rglob("*")}
    code, out = kvbench("baseline", "save", run, "--root", root)
    _clean(out)
    assert code == 2, out
    assert f"{field} {value!r} cannot be a file or folder name" in out
    assert str(run / "bad.json") in out
    assert {p for p in tmp_path.rglob("*")} == before


def test_baseline_save_refuses_a_machine_without_a_name(kvbench, tmp_path: Path) -> None:
    write(make_record(clock="wall"), tmp_path / "run")
    code, out = kvbench("baseline", "save", tmp_path / "run", "--machine", "..",
                        "--root", tmp_path / "b")
    _clean(out)
    assert code == 2 and "has no letters or digits" in out


@pytest.mark.parametrize("name", ["quick-sim", "paged", "contiguous-pow2", "v1.2_x", "A100"])
def test_plain_names_are_path_components(name: str) -> None:
    assert check_path_component(name, "suite") == name


def test_path_component_check_names_what() -> None:
    with pytest.raises(KvbenchError) as err:
        check_path_component("../x", "suite")
    assert str(err.value).startswith("suite '../x' cannot be a file or folder name")
