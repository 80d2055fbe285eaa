"""NaN and infinite values: the gate fails them naming the metric, and no baseline stores
them (stored JSON would hold null, which the gate would skip)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_main import cli
from record_factory import make_record, write


@pytest.fixture
def kvbench(capsys, monkeypatch):
    return cli(capsys, monkeypatch)


def _clean(out: str) -> None:
    assert "Traceback" not in out, out


def _record_json(record, **summary: object) -> str:
    data = record.model_dump(mode="json")
    data["summary"].update(summary)
    return json.dumps(data)  # NaN and Infinity as Python writes them


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(("side", "code", "words"), [
    ("new", 1, "the new value is"), ("baseline", 2, "the baseline's value is"),
])
def test_non_finite_metric_fails_naming_it(
    kvbench, tmp_path: Path, value: float, side: str, code: int, words: str
) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(make_record().to_json())
    bad.write_text(_record_json(make_record(), peak_kv_reserved_bytes=value))
    new, base = (bad, good) if side == "new" else (good, bad)
    got, out = kvbench("compare", new, base)
    _clean(out)
    assert got == code, out
    assert "peak_kv_reserved_bytes" in out and f"{words} {value}" in out


def test_non_finite_repeat_fails(kvbench, tmp_path: Path) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    rec = make_record(clock="wall")
    good.write_text(rec.to_json())
    bad.write_text(_record_json(rec, repeats={"median_ttft_ms": [100.0, math.nan, 101.0]}))
    code, out = kvbench("compare", bad, good)
    _clean(out)
    assert code == 1 and "median_ttft_ms" in out and "the new value is nan" in out


@pytest.mark.parametrize(("side", "code"), [("new", 1), ("baseline", 2)])
def test_non_finite_curve_fails(kvbench, tmp_path: Path, side: str, code: int) -> None:
    t = [float(i) for i in range(1, 11)]
    good = make_record(curves={"t_s": t, "kv_reserved_bytes": [1.0] * 10})
    bad = make_record(curves={"t_s": t, "kv_reserved_bytes": [1.0] * 9 + [math.inf]})
    paths = {"good": tmp_path / "g.json", "bad": tmp_path / "b.json"}
    paths["good"].write_text(good.to_json())
    paths["bad"].write_text(json.dumps(bad.model_dump(mode="python")))
    new, base = (paths["bad"], paths["good"]) if side == "new" else (paths["good"], paths["bad"])
    got, out = kvbench("compare", new, base)
    _clean(out)
    assert got == code, out
    assert "curve:kv_reserved_bytes" in out and "holds inf" in out


def test_curve_shorter_than_its_time_axis_is_unusable(kvbench, tmp_path: Path) -> None:
    t = [float(i) for i in range(1, 11)]
    base = write(make_record(curves={"t_s": t, "kv_reserved_bytes": [1.0] * 10}), tmp_path / "b")
    new = write(make_record(curves={"t_s": t, "kv_reserved_bytes": [1.0] * 7}), tmp_path / "n")
    code, out = kvbench("compare", new, base)
    _clean(out)
    assert code == 2 and "kv_reserved_bytes has 7 points but its time axis t_s has 10" in out


def test_baseline_save_refuses_non_finite_values(kvbench, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "paged.json").write_text(_record_json(make_record(), kv_waste_pct=math.nan))
    code, out = kvbench("baseline", "save", run, "--root", tmp_path / "b")
    _clean(out)
    assert code == 2 and "metric kv_waste_pct is nan" in out
    assert not (tmp_path / "b").exists()
