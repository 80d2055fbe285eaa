"""Thresholds files: the defaults ship inside kvbench, and bad files are refused naming the
file and what to change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_main import cli
from record_factory import make_record, write

from helpers import REPO
from kvbench.errors import InputFileError
from kvbench.report.thresholds import load_thresholds

GOOD = "[metrics.peak_kv_reserved_bytes]\ntolerance = 0.15\n"


@pytest.fixture
def kvbench(capsys, monkeypatch):
    return cli(capsys, monkeypatch)


def test_ci_copy_is_the_packaged_file() -> None:
    ci, packaged = REPO / "ci" / "thresholds.toml", REPO / "kvbench/report/thresholds.toml"
    assert ci.resolve() == packaged.resolve()
    assert load_thresholds() == load_thresholds(ci)


def test_compare_outside_the_repository_uses_the_packaged_defaults(
    kvbench, tmp_path: Path, monkeypatch
) -> None:
    path = write(make_record(), tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    code, out = kvbench("compare", path, path)
    assert code == 0, out
    assert "kvbench/report/thresholds.toml (built in)" in out


def test_compare_in_a_fresh_process_from_another_folder(tmp_path: Path) -> None:
    base = make_record()
    new = base.model_copy(update={"summary": {**base.summary, "kv_waste_pct": 40.0}})
    proc = subprocess.run(
        [sys.executable, "-m", "kvbench.cli.app", "compare",
         str(write(new, tmp_path / "new")), str(write(base, tmp_path / "base"))],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REGRESSION" in proc.stdout and "kv_waste_pct" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_thresholds_option_replaces_the_defaults(kvbench, tmp_path: Path) -> None:
    base = make_record()
    new = base.model_copy(update={"summary": {**base.summary, "kv_waste_pct": 40.0}})
    th = tmp_path / "th.toml"
    th.write_text(GOOD)  # gates peak KV only: the waste change is not judged
    code, out = kvbench("compare", write(new, tmp_path / "n"), write(base, tmp_path / "b"),
                        "--thresholds", th, "--allow-loose")
    assert code == 0, out
    assert f"thresholds `{th}`" in out and "metrics.kv_waste_pct dropped" in out


def test_byte_order_mark_loads(tmp_path: Path) -> None:
    path = tmp_path / "th.toml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load_thresholds(path).metrics["peak_kv_reserved_bytes"].tolerance == 0.15


BAD_CONTENT = {
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8 text (byte 0x89 at offset 0)"),
    "latin-1": ("# d\xe9faut\n".encode("latin-1") + GOOD.encode(), "not UTF-8 text (byte 0xe9"),
    "NUL bytes": (b"[metrics.x]\x00\x00", "holds a NUL byte"),
    "syntax": (b"[metrics.peak_kv_reserved_bytes\ntolerance = 1\n", "invalid TOML"),
    "empty": (b"", "no metrics or curves to gate"),
}


@pytest.mark.parametrize("case", BAD_CONTENT)
def test_unreadable_content(kvbench, tmp_path: Path, case: str) -> None:
    content, words = BAD_CONTENT[case]
    path = tmp_path / "th.toml"
    path.write_bytes(content)
    with pytest.raises(InputFileError) as err:
        load_thresholds(path)
    assert str(err.value).startswith(f"{path}:") and words in str(err.value)
    _assert_compare_refuses(kvbench, tmp_path, path, words)


BAD_RULES = {
    "unknown metric": ("[metrics.peak_kv_reservd_bytes]\ntolerance = 0.1\n",
                       "metrics.peak_kv_reservd_bytes: unknown metric 'peak_kv_reservd_bytes'; "
                       "did you mean 'peak_kv_reserved_bytes'?"),
    "unknown metric, nothing close": ("[metrics.zzz]\ntolerance = 0.1\n",
                                      "unknown metric 'zzz'; gateable metrics: "),
    "unknown curve": ("[curves.kv_reserved]\ntolerance = 0.1\n",
                      "did you mean 'kv_reserved_bytes'?"),
    "metric with no better way": ("[metrics.num_requests]\ntolerance = 0\n",
                                  "metric 'num_requests' describes the run"),
    "exact_tolerance inf": ("[gate]\nexact_tolerance = inf\n" + GOOD,
                            "gate.exact_tolerance: Input should be a finite number"),
    "tolerance nan": ("[metrics.completed]\ntolerance = nan\n",
                      "metrics.completed.tolerance: Input should be a finite number"),
    "tolerance inf": ("[metrics.completed]\ntolerance = inf\n", "finite number"),
    "negative tolerance": ("[metrics.completed]\ntolerance = -0.1\n",
                           "metrics.completed.tolerance: Input should be greater than or equal"),
    "negative abs_tolerance": ("[metrics.completed]\ntolerance = 0\nabs_tolerance = -1\n",
                               "abs_tolerance: Input should be greater than or equal to 0"),
    "tolerance as text": ('[metrics.completed]\ntolerance = "0.1"\n',
                          "metrics.completed.tolerance: Input should be a valid number"),
    "tolerance missing": ("[metrics.completed]\nabs_tolerance = 1\n",
                          "metrics.completed.tolerance: Field required"),
    "negative noise_k": ("[gate]\nnoise_k = -3\n" + GOOD, "gate.noise_k: Input should be greater"),
    "one curve point": ("[gate]\ncurve_points = 1\n" + GOOD, "gate.curve_points: Input should"),
    "curve_points as float": ("[gate]\ncurve_points = 100.5\n" + GOOD, "valid integer"),
    "slack of a whole run": ("[gate]\ncurve_time_slack = 1.0\n" + GOOD,
                             "gate.curve_time_slack: Input should be less than 1"),
    "misspelt gate key": ("[gate]\nnoise-k = 3\n" + GOOD,
                          "gate.noise-k: unknown key; did you mean 'noise_k'?"),
    "misspelt rule key": ("[metrics.completed]\ntolerence = 0\n",
                          "metrics.completed.tolerence: unknown key; did you mean 'tolerance'?"),
    "misspelt section": ("[metric.completed]\ntolerance = 0\n",
                         "metric: unknown key; did you mean 'metrics'?"),
    "rule not a table": ("[metrics]\ncompleted = 0.1\n",
                         "metrics.completed: Input should be a valid dictionary"),
    "direction from an older file": (
        '[metrics.completed]\ndirection = "higher"\ntolerance = 0\n',
        "'direction' is no longer set here (which way is better comes from kvbench's metric "
        "table); remove it"),
    "kind from an older file": ('[metrics.completed]\nkind = "clock"\ntolerance = 0\n',
                                "'kind' is no longer set here"),
    "curve time axis from an older file": (
        '[curves.rss_bytes]\ntime = "rss_t_s"\ntolerance = 0.1\n',
        "'time' is no longer set here (every curve is sampled over t_s)"),
}


@pytest.mark.parametrize("case", BAD_RULES)
def test_invalid_rules(kvbench, tmp_path: Path, case: str) -> None:
    text, words = BAD_RULES[case]
    path = tmp_path / "th.toml"
    path.write_text(text)
    with pytest.raises(InputFileError, match="invalid thresholds") as err:
        load_thresholds(path)
    assert words in str(err.value)
    _assert_compare_refuses(kvbench, tmp_path, path, words)


def test_every_problem_is_listed_at_once(tmp_path: Path) -> None:
    path = tmp_path / "th.toml"
    path.write_text("[metrics.peak_rss]\ntolerance = 0.1\n[metrics.num_steps]\ntolerance = 0\n")
    with pytest.raises(InputFileError) as err:
        load_thresholds(path)
    assert "did you mean 'peak_rss_bytes'?" in str(err.value)
    assert "'num_steps' describes the run" in str(err.value)


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: p.mkdir(), "is a folder, not a thresholds file"),
    (lambda p: None, "no such file (a thresholds file"),
])
def test_thresholds_path_is_not_a_file(kvbench, tmp_path: Path, make, words: str) -> None:
    path = tmp_path / "th.toml"
    make(path)
    _assert_compare_refuses(kvbench, tmp_path, path, words)


def _assert_compare_refuses(kvbench, tmp_path: Path, thresholds: Path, words: str) -> None:
    """compare exits 2 naming the file, and still writes its reports saying why."""
    record = write(make_record(), tmp_path / "run")
    md = tmp_path / "compare.md"
    code, out = kvbench("compare", record, record, "--thresholds", thresholds, "--markdown", md)
    assert "Traceback" not in out
    assert code == 2, out
    assert str(thresholds) in out and words in out
    assert words in md.read_text()
