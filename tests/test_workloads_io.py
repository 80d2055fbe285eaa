"""Workload JSONL files: round trip, validation, and the workload argument."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.errors import InputFileError, KvbenchError
from kvbench.workloads.io import SCHEMA_VERSION, load_workload, load_workload_arg, save_workload
from kvbench.workloads.presets import generate_preset
from kvbench.workloads.traces import import_trace

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["mixed-multimodal", "multi-turn", "parallel-sampling"])
def test_round_trip_preserves_everything(tmp_path: Path, name: str) -> None:
    w = generate_preset(name, num_requests=40, seed=9)
    p = save_workload(w, tmp_path / "sub" / "w.jsonl")
    back = load_workload(p)
    assert back.digest == w.digest
    assert back.requests == w.requests
    assert (back.name, back.seed, back.spec, back.source) == (w.name, w.seed, w.spec, w.source)
    assert not [f for f in p.parent.iterdir() if f.name != "w.jsonl"], "temp file left behind"


def test_round_trip_of_a_trace(tmp_path: Path) -> None:
    w = import_trace("mooncake", FIXTURES / "mooncake_synthetic_trace_head300.jsonl")
    assert load_workload(save_workload(w, tmp_path / "m.jsonl")).digest == w.digest


def test_header_line(tmp_path: Path) -> None:
    w = generate_preset("mixed-text", num_requests=5)
    lines = save_workload(w, tmp_path / "w.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["kvbench_workload"] == SCHEMA_VERSION
    assert header["digest"] == w.digest and header["num_requests"] == 5 == len(lines) - 1
    assert set(header) == {"kvbench_workload", "name", "seed", "spec", "source", "digest",
                           "num_requests"}


def _saved(tmp_path: Path) -> tuple[Path, list[str]]:
    p = save_workload(generate_preset("shared-prefix", num_requests=6), tmp_path / "w.jsonl")
    return p, p.read_text().splitlines()


def _edit(p: Path, lines: list[str], index: int, change: dict) -> None:
    obj = json.loads(lines[index])
    obj.update(change)
    lines = [*lines[:index], json.dumps(obj), *lines[index + 1 :]]
    p.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("index", "change", "line", "message"),
    [
        (0, {"kvbench_workload": 99}, 1, "schema version 99 is not supported"),
        (0, {"seed": "zero"}, 1, "bad header: seed"),
        (3, {"arrival_s": -1.0}, 4, "arrival_s"),
        (3, {"output_tokens": -1}, 4, "output_tokens"),
        (3, {"segments": [{"kind": "video", "tokens": 3, "key": "k"}]}, 4, "segments.0.kind"),
        (3, {"segments": [{"kind": "text", "tokens": 0, "key": "k"}]}, 4, "segments.0.tokens"),
        (3, {"segments": []}, 4, "segments"),
        (3, {"n": 0}, 4, "n: Input should be greater than or equal to 1"),
        (3, {"id": "r1"}, 4, "request id 'r1' appears twice"),
        (3, {"extra": 1}, 4, "extra: Extra inputs"),
    ],
)
def test_bad_lines_name_file_and_line(
    tmp_path: Path, index: int, change: dict, line: int, message: str
) -> None:
    p, lines = _saved(tmp_path)
    _edit(p, lines, index, change)
    with pytest.raises(InputFileError, match=message) as e:
        load_workload(p)
    assert str(e.value).startswith(f"{p}:{line}: ")


def test_decreasing_arrival_names_the_line(tmp_path: Path) -> None:
    p, lines = _saved(tmp_path)
    _edit(p, lines, 2, {"arrival_s": 1.0e6})
    with pytest.raises(InputFileError, match="before the previous request") as e:
        load_workload(p)
    assert e.value.line == 4


def test_digest_mismatch_names_the_file(tmp_path: Path) -> None:
    p, lines = _saved(tmp_path)
    obj = json.loads(lines[2])
    obj["output_tokens"] += 1
    _edit(p, lines, 2, obj)
    with pytest.raises(InputFileError, match="does not match the header") as e:
        load_workload(p)
    assert str(e.value).startswith(f"{p}: ")


def test_truncated_and_foreign_files(tmp_path: Path) -> None:
    p, lines = _saved(tmp_path)
    p.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(InputFileError, match="header says 6 requests but the file holds 5"):
        load_workload(p)
    p.write_text('{"hello": 1}\n')
    with pytest.raises(InputFileError, match="not a kvbench workload file"):
        load_workload(p)
    p.write_text("")
    with pytest.raises(InputFileError, match="empty file"):
        load_workload(p)
    with pytest.raises(InputFileError, match="no such file"):
        load_workload(tmp_path / "nope.jsonl")


def test_workload_argument(tmp_path: Path) -> None:
    w = load_workload_arg("multi-turn", num_requests=12, seed=4)
    assert len(w) == 12 and w.digest == generate_preset("multi-turn", 12, 4).digest
    p = save_workload(w, tmp_path / "w.jsonl")
    assert load_workload_arg(str(p)).digest == w.digest
    first5 = load_workload_arg(str(p), num_requests=5)
    assert first5.requests == w.requests[:5] and first5.warnings == []
    more = load_workload_arg(str(p), num_requests=13)
    assert more.requests == w.requests
    assert more.warnings == [f"asked for 13 requests but {p} holds 12; using all of them"]
    with pytest.raises(KvbenchError, match="number of requests must be >= 1"):
        load_workload_arg(str(p), num_requests=0)
    with pytest.raises(KvbenchError, match=r"not a preset \(valid: mixed-text.*\.jsonl file"
                       r" or KIND:TRACE_PATH \(KIND one of azure, azure-lmm, mooncake"):
        load_workload_arg("mixed_text")
    with pytest.raises(InputFileError, match="no such file"):
        load_workload_arg(str(tmp_path / "absent.jsonl"))


def test_workload_argument_names_a_trace() -> None:
    path = FIXTURES / "mooncake_synthetic_trace_head300.jsonl"
    w = load_workload_arg(f"mooncake:{path}", num_requests=10, seed=2)
    assert w.digest == import_trace("mooncake", path, limit=10, seed=2).digest
    assert len(w) == 10 and w.warnings == []
    everything = load_workload_arg(f"mooncake:{path}", num_requests=1000)
    assert len(everything) == 300
    assert everything.warnings == [
        f"asked for 1,000 requests but {path} holds 300; using all of them"
    ]
