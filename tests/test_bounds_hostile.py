"""Bounded inputs and resources: files read as streams and only as far as needed, JSON
nested past the parser's depth, names too long for the file system, grid workers and
sizes, replicas that would not fit in memory, and tensor-parallel degrees that split no
head. Every refusal exits 2 with a message and no traceback, before any work or write."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest
from cli_main import cli
from record_factory import make_record, write

from kvbench.errors import KvbenchError
from kvbench.results.schema import MAX_RECORD_BYTES
from kvbench.run.cluster import check_replica_memory
from kvbench.run.overrides import RunFlags, resolve_suite
from kvbench.run.plan import plan_run
from kvbench.tools.grid import (
    MAX_GRID_POINTS,
    WORKERS_PER_CORE,
    check_grid_size,
    local_workers,
    parse_axis,
    run_grid,
)
from kvbench.workloads.io import load_workload, save_workload
from kvbench.workloads.presets import generate_preset
from kvbench.workloads.textstream import CHUNK_BYTES

AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_LMM_HEAD = "TIMESTAMP,NumImages,ContextTokens,GeneratedTokens\n"
SHAREGPT_ITEM = {"conversations": [{"from": "human", "value": "hi there"},
                                   {"from": "gpt", "value": "hello"}]}


@pytest.fixture
def kvbench(capsys, monkeypatch):
    return cli(capsys, monkeypatch)


def _refused(code: int, out: str, *words: str) -> None:
    assert code == 2, out
    assert "Traceback" not in out, out
    text = " ".join(out.split())
    for word in words:
        assert word in text, (word, out)


def _garbage(nbytes: int) -> str:
    """Lines no reader of any format accepts, ``nbytes`` of them in all."""
    line = "this line is no row of any workload or trace file: {[\n"
    return line * (nbytes // len(line) + 1)


# --- streams: only the head a run needs is read --------------------------------------------

def _workload_head(tmp_path: Path) -> str:
    path = save_workload(generate_preset("mixed-text", num_requests=10), tmp_path / "w.jsonl")
    return path.read_text()


def _heads(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Per format: (file name, a valid head of at least 6 requests)."""
    mooncake = "".join(
        json.dumps({"timestamp": i, "input_length": 600, "output_length": 4,
                    "hash_ids": [1, 2 + i]}) + "\n" for i in range(6))
    azure = AZURE_HEAD + "".join(f"2023-11-16 18:15:4{i}.5,374,44\n" for i in range(6))
    lmm = AZURE_LMM_HEAD + "".join(f"2024-10-15T12:00:0{i}.269Z,1,900,20\n" for i in range(6))
    sharegpt = "[\n" + ",\n".join(json.dumps(SHAREGPT_ITEM) for _ in range(6)) + ",\n"
    return {"workload": ("w.jsonl", _workload_head(tmp_path)), "azure": ("a.csv", azure),
            "azure-lmm": ("l.csv", lmm), "mooncake": ("m.jsonl", mooncake),
            "sharegpt": ("s.json", sharegpt)}


@pytest.mark.parametrize("kind", ["workload", "azure", "azure-lmm", "mooncake", "sharegpt"])
def test_num_requests_reads_only_the_head(kvbench, tmp_path: Path, kind: str) -> None:
    name, head = _heads(tmp_path)[kind]
    path = tmp_path / f"big-{name}"
    path.write_text(head + _garbage(3 * CHUNK_BYTES))  # a tail past the first chunks
    arg = str(path) if kind == "workload" else f"{kind}:{path}"
    code, out = kvbench("workload", "show", arg, "--num-requests", "4")
    assert code == 0, out
    assert "│ num_requests │ 4 │" in " ".join(out.split()), out
    # Read whole, the tail is refused: the run above never read it.
    code, out = kvbench("workload", "show", arg)
    _refused(code, out, str(path))


def test_a_run_reads_only_the_head_it_replays(kvbench, tmp_path: Path) -> None:
    name, head = _heads(tmp_path)["mooncake"]
    path = tmp_path / name
    path.write_text(head + _garbage(3 * CHUNK_BYTES))
    code, out = kvbench("run", "quick-sim", "--workload", f"mooncake:{path}", "--engines",
                        "paged", "--num-requests", "4", "--out", tmp_path / "o")
    assert code == 0, out
    record = json.loads((tmp_path / "o" / "paged.json").read_text())
    assert record["workload"]["num_requests"] == 4 and record["status"] == "ok"


def test_sharegpt_on_one_line_is_parsed_a_conversation_at_a_time(kvbench, tmp_path) -> None:
    items = json.dumps([SHAREGPT_ITEM] * 20_000)  # minified: one line of ~2 MB
    path = tmp_path / "one-line.json"
    path.write_text(items[:-1] + ", {" + "x" * (2 * CHUNK_BYTES))  # never closed
    code, out = kvbench("workload", "import", "sharegpt", path, "--limit", "20000",
                        "-o", tmp_path / "w.jsonl")
    assert code == 0, out
    assert len((tmp_path / "w.jsonl").read_text().splitlines()) == 20_001
    code, out = kvbench("workload", "import", "sharegpt", path, "-o", tmp_path / "x.jsonl")
    _refused(code, out, str(path), "not valid JSON")
    assert not (tmp_path / "x.jsonl").exists()


def test_a_large_workload_file_loads_its_head_in_little_memory(tmp_path: Path) -> None:
    path = tmp_path / "large.jsonl"
    path.write_text(_workload_head(tmp_path) + _garbage(48 << 20))
    size = path.stat().st_size
    tracemalloc.start()
    try:
        workload = load_workload(path, limit=4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(workload.requests) == 4
    assert [r.id for r in workload.requests] == [
        r.id for r in generate_preset("mixed-text", num_requests=10).requests[:4]]
    assert peak < size / 8, (peak, size)


# --- JSON and TOML nested past the parser's depth ------------------------------------------

def _deep(n: int = 100_000) -> str:
    return "[" * n + "]" * n


def test_deeply_nested_inputs_are_refused(kvbench, tmp_path: Path) -> None:
    deep = _deep()
    files = {
        "record.json": '{"schema_version": 1, "summary": ' + deep + "}",
        "s.json": "[" + deep + "]",
        "m.jsonl": '{"timestamp": 0, "hash_ids": ' + deep + "}\n",
        "spec.json": '{"classes": ' + deep + "}",
        "spec.toml": "classes = " + deep + "\n",
        "suite.toml": "x = " + deep + "\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    lines = _workload_head(tmp_path).splitlines()
    (tmp_path / "header.jsonl").write_text('{"kvbench_workload": ' + deep + "}\n")
    (tmp_path / "row.jsonl").write_text("\n".join([*lines[:2], '{"id": ' + deep + "}"]) + "\n")
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "paged.json").write_text(files["record.json"])
    out_file = tmp_path / "out.jsonl"
    for args, words in [
        (["compare", tmp_path / "record.json", tmp_path / "record.json"], ["nested too deeply"]),
        (["report", tmp_path / "records", "-o", tmp_path / "rep"], ["nested too deeply"]),
        (["workload", "import", "sharegpt", tmp_path / "s.json", "-o", out_file],
         ["s.json:1", "nested too deeply"]),
        (["workload", "import", "mooncake", tmp_path / "m.jsonl", "-o", out_file],
         ["m.jsonl:1", "nested too deeply"]),
        (["workload", "gen", "--spec", tmp_path / "spec.json", "-o", out_file],
         ["nested too deeply"]),
        (["workload", "gen", "--spec", tmp_path / "spec.toml", "-o", out_file],
         ["nested too deeply"]),
        (["run", tmp_path / "suite.toml"], ["suite.toml", "nested too deeply"]),
        (["workload", "show", tmp_path / "header.jsonl"], ["header.jsonl:1", "nested too"]),
        (["workload", "show", tmp_path / "row.jsonl"], ["row.jsonl:3", "recursion limit"]),
    ]:
        code, out = kvbench(*args)
        _refused(code, out, *words)
    assert not out_file.exists() and not (tmp_path / "rep").exists()


def test_a_record_above_the_cap_is_refused_unread(kvbench, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    write(make_record("contiguous"), folder)
    huge = folder / "paged.json"
    with huge.open("wb") as fh:  # sparse: no disk is used
        fh.truncate(MAX_RECORD_BYTES + 1)
    before = sorted(p.name for p in folder.iterdir())
    code, out = kvbench("baseline", "save", folder, "--root", tmp_path / "baselines")
    _refused(code, out, "paged.json", "2.0 GiB", "more than the 2.0 GiB a run record may take")
    code, out = kvbench("compare", huge, folder / "contiguous.json")
    _refused(code, out, "paged.json", "2.0 GiB")
    assert not (tmp_path / "baselines").exists()
    assert sorted(p.name for p in folder.iterdir()) == before
    assert huge.stat().st_size == MAX_RECORD_BYTES + 1


# --- names that become paths -----------------------------------------------------------------

def _suite(tmp_path: Path, engine: str, name: str = "s") -> Path:
    path = tmp_path / "long.toml"
    path.write_text(f"name = '{name}'\n[engines.{engine}]\nkind = 'paged'\n[run]\n"
                    f"device = 'sim:a100-80gb'\nengines = ['{engine}']\n")
    return path


def test_long_names_are_refused_before_any_work(kvbench, tmp_path: Path) -> None:
    out = tmp_path / "o"
    long = "e" * 300
    code, text = kvbench("run", _suite(tmp_path, long), "--num-requests", "2", "--out", out)
    _refused(code, text, "engine name", "300 characters", "at most 128")
    code, text = kvbench("run", "quick-sim", "--engines", f"paged,{long}", "--num-requests", "2",
                         "--out", out)
    _refused(code, text, "--engines", "300 characters")
    code, text = kvbench("run", _suite(tmp_path, "paged", "s" * 300), "--num-requests", "2",
                         "--out", out)
    _refused(code, text, "suite name", "300 characters")
    assert not out.exists()


@pytest.mark.parametrize("field", ["suite", "engine", "machine"])
def test_baseline_save_refuses_long_names(kvbench, tmp_path: Path, field: str) -> None:
    run = tmp_path / "run"
    long = "n" * 5000
    record = make_record(suite=long) if field == "suite" else make_record(
        long if field == "engine" else "paged", clock="wall" if field == "machine" else "virtual")
    write(record, run, "r")
    machine = ["--machine", long] if field == "machine" else []
    code, out = kvbench("baseline", "save", run, "--root", tmp_path / "b", *machine)
    _refused(code, out, f"{field} name", "5,000 characters", "r.json")
    assert not (tmp_path / "b").exists()


def test_paths_too_long_for_the_file_system(kvbench, tmp_path: Path) -> None:
    long = "p" * 5000
    for args, words in [
        (["run", long], ["suite", "5,000 bytes", "too long a path"]),
        (["run", long + ".toml"], ["too long a path"]),
        (["run", "quick-sim", "--workload", long, "--out", tmp_path / "o"],
         ["--workload", "too long a path"]),
        (["workload", "show", long + ".jsonl"], ["File name too long"]),
        (["workload", "import", "azure", long + ".csv", "-o", tmp_path / "w.jsonl"],
         ["File name too long"]),
        (["compare", tmp_path / long, tmp_path / long], ["File name too long"]),
    ]:
        code, out = kvbench(*args)
        _refused(code, out, *words)
    assert list(tmp_path.iterdir()) == []


# --- grid workers and size ---------------------------------------------------------------------

def test_workers_are_capped_at_points_and_cores() -> None:
    cores = os.cpu_count() or 1
    assert local_workers(300, 2) == (2, "--workers 300: running 2 worker processes "
                                        "(one per point of 2)")
    many, why = local_workers(100_000, 10_000)
    assert many == min(10_000, WORKERS_PER_CORE * cores)
    assert why is not None and "100,000" in why
    assert local_workers(2, 2) == (2, None)
    with pytest.raises(KvbenchError, match="at least 1"):
        local_workers(0, 2)


def test_sweep_caps_workers_and_says_so_once(kvbench, tmp_path: Path) -> None:
    out = tmp_path / "g"
    code, text = kvbench("sweep", "quick-sim", "--engines", "paged", "--num-requests", "2",
                         "--grid", "seed=1,2", "--workers", "300", "--out", out)
    assert code == 0, text
    assert text.count("--workers 300: running 2 worker processes") == 1, text
    assert "on 2 local workers" in text
    assert "2 workers" in (out / "grid.md").read_text()
    assert len(list(out.glob("p*/paged.json"))) == 2


def test_run_grid_caps_workers_itself(tmp_path: Path) -> None:
    suite, base = resolve_suite("quick-sim", RunFlags(num_requests=2, engines="paged"))
    result = run_grid(suite, base, [parse_axis("seed=1")], tmp_path / "g", "t", workers=64)
    assert result.workers == 1 and result.failed == 0


def test_a_grid_above_the_cap_needs_yes(kvbench, tmp_path: Path) -> None:
    out = tmp_path / "g"
    write(make_record("paged"), out)  # an earlier run's record, which --force would remove
    values = ",".join(str(v) for v in range(1, 102))
    code, text = kvbench("sweep", "quick-sim", "--grid", f"seed={values}", "--grid",
                         f"max_num_seqs={','.join(str(v) for v in range(1, 101))}",
                         "--out", out, "--force")
    _refused(code, text, "10,100 points", f"more than {MAX_GRID_POINTS:,}", "--yes")
    assert (out / "paged.json").exists()
    code, text = kvbench("capacity", "--model", "tiny", "--gpu", "h200", "--seq-len", "64",
                         "--grid", f"max_num_seqs={values}", "--grid",
                         f"kv_memory={','.join(f'{v}MiB' for v in range(1, 101))}")
    _refused(code, text, "10,100 points", "--yes")
    axes = [parse_axis(f"seed={values}"), parse_axis("block_size=" + ",".join(
        str(v) for v in range(1, 1001)))]
    assert check_grid_size(axes, yes=True) == 101_000
    with pytest.raises(KvbenchError, match="101,000 points"):
        check_grid_size(axes, yes=False)


# --- replicas ----------------------------------------------------------------------------------

def _planned(tmp_path: Path, **flags):
    suite, base = resolve_suite("quick-sim", RunFlags(num_requests=4, engines="paged",
                                                      **flags))
    return plan_run(suite, base, tmp_path / "o", "t")


# Counts past any machine's memory: each replica takes at least its engine and 32 KiB.
@pytest.mark.parametrize("shape", [{"replicas": 10**8},
                                   {"prefill_replicas": 5 * 10**7, "decode_replicas": 5 * 10**7}])
def test_replicas_beyond_memory_are_refused_with_the_estimate(tmp_path, shape) -> None:
    plan = _planned(tmp_path, replicas=2)
    cluster = plan.suite.cluster.model_copy(update={"replicas": 1, **shape})
    with pytest.raises(KvbenchError) as err:
        check_replica_memory(cluster, plan.engines, len(plan.workload.requests))
    message = str(err.value)
    assert "100,000,000 replicas would need about" in message
    assert "more than this machine's" in message and "use at most about" in message
    check_replica_memory(plan.suite.cluster, plan.engines, len(plan.workload.requests))


def test_the_replica_estimate_follows_the_pool(tmp_path: Path) -> None:
    """A KV pool of many pages costs its bookkeeping per replica: the estimate measures it."""
    small = _planned(tmp_path, replicas=2, kv_memory="1GiB")  # 128 blocks
    large = _planned(tmp_path / "l", replicas=2, device="sim:a100-80gb")  # 7530 blocks
    each = []
    for plan in (small, large):
        cluster = plan.suite.cluster.model_copy(update={"replicas": 10**9})
        with pytest.raises(KvbenchError) as err:
            check_replica_memory(cluster, plan.engines, 4)
        each.append(str(err.value).split(" each")[0].rsplit("(", 1)[1])
    assert each[0].endswith("KiB") and each[1].endswith("KiB")
    assert float(each[1].split()[0]) > 5 * float(each[0].split()[0])


# --- tensor parallelism ------------------------------------------------------------------------

def test_capacity_shares_runs_tensor_parallel_check(kvbench, tmp_path: Path) -> None:
    words = ["tensor parallelism 3", "32 attention heads", "use one of 1, 2, 4, 8, 16, 32"]
    code, out = kvbench("capacity", "--model", "llama-2-7b", "--gpu", "h200", "--tp", "3",
                        "--seq-len", "2048", "--csv", tmp_path / "c.csv")
    _refused(code, out, *words)
    assert "170.7 KiB" not in out and not (tmp_path / "c.csv").exists()
    code, out = kvbench("run", "quick-sim", "--device", "sim:h200x3", "--num-requests", "2",
                        "--out", tmp_path / "o")
    _refused(code, out, *words)
    code, out = kvbench("capacity", "--model", "llama-2-7b", "--gpu", "h200", "--grid",
                        "tp=1,3", "--seq-len", "2048", "--json", tmp_path / "g.json")
    assert code == 0, out
    rows = json.loads((tmp_path / "g.json").read_text())
    assert {r["tp"] for r in rows["rows"]} == {1}
    assert any("tp=3: tensor parallelism 3" in n for n in rows["notes"])
