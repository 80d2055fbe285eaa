"""Damaged or unusual record files given to compare, publish, report and baseline save: each
is refused naming the file and what is wrong, without a traceback; JSON that is no record is
passed over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_main import cli
from record_factory import make_record, write

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


@pytest.fixture
def kvbench(capsys, monkeypatch):
    return cli(capsys, monkeypatch)


def _clean(out: str) -> None:
    assert "Traceback" not in out, out


def _record_json(record, **summary: object) -> str:
    data = record.model_dump(mode="json")
    data["summary"].update(summary)
    return json.dumps(data)  # NaN and Infinity as Python writes them


DAMAGE = {
    "truncated": (lambda: make_record().to_json()[:300].encode(),
                  "a truncated or damaged run record"),
    "empty": (lambda: b"", "not valid JSON"),
    "binary": (lambda: PNG, "not UTF-8 text (byte 0x89"),
    "latin-1": (lambda: '{"engine": "caf\xe9"}'.encode("latin-1"), "not UTF-8 text (byte 0xe9"),
    "garbage metric": (lambda: _record_json(make_record(), median_ttft_ms="fast").encode(),
                       "metric 'median_ttft_ms' is str"),
    "garbage repeats": (lambda: _record_json(make_record(), repeats={"x": []}).encode(),
                        "repeats must map metric names to non-empty lists of numbers"),
    "not a record": (lambda: b'{"schema_version": 1, "engine": "paged", "summary": {}}',
                     "invalid run record: kvbench_version: Field required"),
}


def _damaged_folder(tmp_path: Path, damage: str) -> tuple[Path, Path]:
    """A run folder with one good record and one damaged one beside it."""
    run = tmp_path / "run"
    write(make_record("paged"), run)
    bad = run / "contiguous.json"
    bad.write_bytes(DAMAGE[damage][0]())
    return run, bad


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("side", ["new", "baseline"])
def test_compare_refuses_a_damaged_record_in_a_folder(
    kvbench, tmp_path: Path, damage: str, side: str
) -> None:
    run, bad = _damaged_folder(tmp_path, damage)
    good = write(make_record("paged"), tmp_path / "other")
    new, base = (run, good) if side == "new" else (good, run)
    md = tmp_path / "compare.md"
    code, out = kvbench("compare", new, base, "--markdown", md)
    _clean(out)
    assert code == 2, out
    assert str(bad) in out and DAMAGE[damage][1] in out
    # The report still says why, for CI to show.
    assert str(bad) in md.read_text()


@pytest.mark.parametrize("damage", ["truncated", "binary", "garbage metric"])
@pytest.mark.parametrize("command", ["publish", "report", "baseline save"])
def test_readers_refuse_a_damaged_record(
    kvbench, tmp_path: Path, damage: str, command: str
) -> None:
    run, bad = _damaged_folder(tmp_path, damage)
    out_dir = tmp_path / "out"
    args = {"publish": ["publish", run, "-o", out_dir], "report": ["report", run, "-o", out_dir],
            "baseline save": ["baseline", "save", run, "--root", out_dir]}[command]
    code, out = kvbench(*args)
    _clean(out)
    assert code == 2, out
    assert str(bad) in out and DAMAGE[damage][1] in out
    assert not out_dir.exists()


def test_other_json_in_a_folder_is_not_a_record(kvbench, tmp_path: Path) -> None:
    run = tmp_path / "run"
    path = write(make_record(), run)
    (run / "compare.json").write_text('{"strict": false, "rows": []}')
    (run / "sharegpt.json").write_text('[{"conversations": []}]')
    # A folder named like a record is searched, not read as a file.
    write(make_record("contiguous"), run / "nested.json")
    code, out = kvbench("compare", run, run)
    _clean(out)
    assert code == 0, out
    assert str(path) in out and "nested.json/contiguous.json" in out


def test_a_record_with_a_byte_order_mark_loads(kvbench, tmp_path: Path) -> None:
    path = tmp_path / "paged.json"
    path.write_bytes(b"\xef\xbb\xbf" + make_record().to_json().encode())
    code, out = kvbench("compare", path, path)
    assert code == 0, out


def test_a_record_file_that_is_not_a_regular_file(kvbench, tmp_path: Path) -> None:
    code, out = kvbench("compare", "/dev/null", tmp_path)
    _clean(out)
    assert code == 2 and "/dev/null: is not a regular file" in out


def test_report_needs_folders(kvbench, tmp_path: Path) -> None:
    path = write(make_record(), tmp_path)
    code, out = kvbench("report", path, "-o", tmp_path / "out")
    _clean(out)
    assert code == 2 and "not a folder of run records" in out
