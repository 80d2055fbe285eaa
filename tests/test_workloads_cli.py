"""The ``kvbench workload`` commands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.errors import InputFileError, KvbenchError
from kvbench.workloads.generator import generate
from kvbench.workloads.io import load_workload
from kvbench.workloads.presets import generate_preset
from kvbench.workloads.specfile import load_spec_file

FIXTURES = Path(__file__).parent / "fixtures"
SPEC_TOML = """\
num_requests = 40
arrival = { kind = "gamma", rate = 4.0, burstiness = 0.5 }

[[classes]]
name = "chat"
weight = 3
prompt = { kind = "lognormal", median = 200, sigma = 0.9, max = 1024 }
output = { kind = "uniform", low = 16, high = 256 }
prefix = { templates = 2, tokens = { kind = "fixed", value = 64 } }
session = { turns = { kind = "uniform", low = 2, high = 4 }, think_time_s = 5.0 }

[[classes]]
name = "photo"
prompt = { kind = "uniform", low = 8, high = 64 }
output = { kind = "fixed", value = 32 }
audio = { seconds = { kind = "uniform", low = 1, high = 5 } }

[classes.images]
count = { kind = "uniform", low = 1, high = 2 }
sizes = [[448, 448], [336, 672]]
rule = "qwen2-vl"
"""


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200"})


def test_gen_from_a_spec_file(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "chat.toml"
    spec.write_text(SPEC_TOML)
    out = tmp_path / "w.jsonl"
    result = runner.invoke(app, ["workload", "gen", "--spec", str(spec), "-o", str(out),
                                 "--seed", "3"])
    assert result.exit_code == 0, result.output
    w = load_workload(out)
    assert len(w) == 40 and w.name == "chat" and w.source == f"spec {spec}"
    assert w.digest == generate(load_spec_file(spec), None, 3).digest
    assert f"40 requests, digest {w.digest}" in result.output
    kinds = {s.kind for r in w.requests for s in r.segments}
    assert kinds == {"text", "image", "audio"}
    assert any(r.session_id for r in w.requests) and any(r.prefix_group for r in w.requests)
    # The same spec as JSON gives the same workload.
    as_json = tmp_path / "chat.json"
    as_json.write_text(json.dumps(tomllib.loads(SPEC_TOML)))
    assert generate(load_spec_file(as_json), None, 3).digest == w.digest


def test_gen_from_a_preset_and_its_errors(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "p.jsonl"
    result = runner.invoke(app, ["workload", "gen", "multi-turn", "-o", str(out),
                                 "--num-requests", "12", "--seed", "4"])
    assert result.exit_code == 0, result.output
    assert load_workload(out).digest == generate_preset("multi-turn", 12, 4).digest
    both = runner.invoke(app, ["workload", "gen", "multi-turn", "--spec", "x.toml", "-o", "o"])
    assert isinstance(both.exception, KvbenchError)
    assert "give a preset name or --spec FILE" in str(both.exception)
    bad = tmp_path / "bad.toml"
    bad.write_text(SPEC_TOML.replace("median = 200", "median = -2"))
    result = runner.invoke(app, ["workload", "gen", "--spec", str(bad), "-o", str(out)])
    assert isinstance(result.exception, KvbenchError)
    assert str(result.exception).startswith(
        f"{bad}: invalid workload spec: classes[0].prompt.median: Input should be greater than 0"
    )


def test_import_and_show_print_warnings(runner: CliRunner, tmp_path: Path) -> None:
    trace = FIXTURES / "azure_llm_2023_conv_head500.csv"
    out = tmp_path / "a.jsonl"
    result = runner.invoke(app, ["workload", "import", "azure", str(trace), "-o", str(out),
                                 "--limit", "600"])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.output and "asked for 600 requests" in result.output
    assert len(load_workload(out)) == 500
    shown = runner.invoke(app, ["workload", "show", str(out)])
    assert shown.exit_code == 0 and "num_requests" in shown.output and "500" in shown.output
    shown = runner.invoke(app, ["workload", "show", f"azure:{trace}", "--num-requests", "20"])
    assert shown.exit_code == 0, shown.output
    assert re.search(r"num_requests\s+│ 20\s", shown.output)
    folder = runner.invoke(app, ["workload", "import", "mooncake", str(tmp_path), "-o", "x"])
    assert isinstance(folder.exception, InputFileError)


def test_bad_input_exits_2_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "a.csv"
    bad.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-01 00:00:00,5,1\n")
    proc = subprocess.run(
        [sys.executable, "-c", "from kvbench.cli.app import main; main()", "workload", "import",
         "azure", str(bad), "-o", str(tmp_path / "o.jsonl")],
        capture_output=True, text=True, env={"COLUMNS": "300", "PATH": ""},
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{bad}:2: TIMESTAMP '2023-13-01 00:00:00' is not a real date" in proc.stderr
