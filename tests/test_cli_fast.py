"""A fast command line: the commands that read, list or help never import torch; `--version`;
the help grouped by workflow; close matches offered for misspelt names; sizes need a unit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_main import cli

import kvbench

# Runs the CLI's app as `kvbench ARGS` would, then reports whether torch was imported.
_PROBE = """
import json, sys
from kvbench.cli.app import app
try:
    app(args=json.loads(sys.argv[1]), prog_name="kvbench", standalone_mode=False)
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules)
"""


def _probe(args: list[str], cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args)], cwd=cwd, capture_output=True,
        text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A simulated run's records, for the commands that read records."""
    out = tmp_path_factory.mktemp("run") / "quick"
    done = subprocess.run(
        [sys.executable, "-m", "kvbench.cli", "run", "quick-sim", "--num-requests", "3",
         "--engines", "paged", "--repeat", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], ["list"], ["compare", "--help"], ["report", "--help"],
    ["publish", "--help"], ["workload", "show", "mixed-text"], ["run", "--help"],
])
def test_reading_and_help_commands_never_import_torch(args: list[str], tmp_path: Path) -> None:
    out = _probe(args, tmp_path)
    assert out.rstrip().endswith("torch imported: False"), out


def test_the_probe_sees_torch_where_a_command_needs_it(tmp_path: Path) -> None:
    # `machine` names torch's version in the baseline name: it must import torch.
    assert _probe(["machine"], tmp_path).rstrip().endswith("torch imported: True")


def test_commands_on_records_never_import_torch(records: Path, tmp_path: Path) -> None:
    for args in (["compare", str(records), str(records)],
                 ["report", str(records), "-o", str(tmp_path / "report")],
                 ["publish", str(records), "-o", str(tmp_path / "tables")]):
        out = _probe(args, tmp_path)
        assert out.rstrip().endswith("torch imported: False"), (args, out)
    assert (tmp_path / "report" / "report.md").is_file()
    assert (tmp_path / "tables" / "tables.md").is_file()


def test_version_prints_the_package_version(capsys, monkeypatch) -> None:
    kvbench_cli = cli(capsys, monkeypatch)
    code, out = kvbench_cli("--version")
    assert code == 0
    assert out.strip() == f"kvbench {kvbench.__version__}"


def test_help_groups_commands_by_workflow(capsys, monkeypatch) -> None:
    from kvbench.cli.app import HELP_ORDER

    code, out = cli(capsys, monkeypatch)("--help")
    assert code == 0
    panels = ["Run benchmarks", "Compare, gate and publish results", "Workloads",
              "Plan capacity, calibrate, check claims", "Presets and this machine"]
    at = [out.index(p) for p in panels]
    assert at == sorted(at), out
    assert "─ Commands ─" not in out  # every command sits in a workflow's panel
    rows = [line.split()[1] for line in out.splitlines()
            if line.startswith("│ ") and len(line.split()) > 1 and line.split()[1].isalpha()]
    commands = [r for r in rows if r in HELP_ORDER]
    assert commands == list(HELP_ORDER), out


@pytest.mark.parametrize(("args", "message"), [
    (["--engines", "pagedd"], "unknown engine 'pagedd'; did you mean 'paged'? valid engines: "),
    (["--model", "llama3-8b"], "unknown model preset 'llama3-8b'; did you mean 'llama-3-8b'? "
                               "valid presets: "),
    (["--device", "sim:a100-80g"], "unknown GPU 'a100-80g'; did you mean 'a100-80gb'? "
                                   "valid GPUs: "),
    (["--workload", "mixed-txt"], "unknown workload preset 'mixed-txt'; did you mean "
                                  "'mixed-text'? valid: "),
    (["quik-sim"], "no suite 'quik-sim': did you mean 'quick-sim'? give a .toml file path"),
    (["--engines", "zzz"], "unknown engine 'zzz'; valid engines: contiguous"),
    (["--kv-memory", "1"], "--kv-memory 1: a size needs a unit, e.g. 1GiB or 1MiB"),
    (["--kv-memory", "8388608"], "--kv-memory 8388608: a size needs a unit, e.g. 8388608B or "
                                 "8388608MiB"),
    (["--kv-memory", "0"], "--kv-memory 0 must be positive"),
    (["--kv-memory", "12 parsecs"], "--kv-memory 12 parsecs: cannot read this size"),
])
def test_misspelt_names_and_unitless_sizes_are_refused_with_a_suggestion(
    args: list[str], message: str, capsys, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = cli(capsys, monkeypatch)("run", "--num-requests", "2", *args)
    assert code == 2, out
    assert message in out
    assert "Traceback" not in out
    assert not (tmp_path / "runs").exists()  # refused before any output folder
