"""Capacity planning: figures by hand, against the real KV managers, TP scaling, the CLI."""

from __future__ import annotations

import csv
import json
import math

import pytest
from typer.testing import CliRunner

from helpers import run_cli, text_request
from kvbench.cli.app import app
from kvbench.engines.kv.offload import OffloadSpec
from kvbench.engines.model.presets import get_preset
from kvbench.engines.sequence import Sequence
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import MiB, get_gpu
from kvbench.engines.sim.kv_budget import profile_activation_bytes
from kvbench.errors import KvbenchError
from kvbench.tools.capacity import (
    Demand,
    Deployment,
    concurrency_curve,
    plan,
    plan_tiers,
    policies,
    prefill_s,
)


def _by_policy(rows):
    return {r.policy: r for r in rows}


def test_llama2_7b_on_a100_by_hand() -> None:
    p = get_preset("llama-2-7b")
    dep = Deployment(p, get_gpu("a100-80gb"), max_model_len=4096)
    rows = _by_policy(plan(dep, policies([16, 32]), [Demand(2048)]))
    bpt = 2 * 32 * 32 * 128 * 2  # layers x KV heads x head dim x K,V x fp16 bytes
    assert bpt == 512 * 1024
    # vLLM's rule: 0.9 x memory - weights - the profiling forward's activation peak (8192
    # tokens over 256 sequences) - non-torch memory.
    budget = (math.ceil(81920 * MiB * 0.9) - p.weight_bytes
              - profile_activation_bytes(p, 1, 8192, 256) - get_gpu("a100-80gb").non_torch_bytes)
    for r in rows.values():
        assert r.kv_bytes_per_token == bpt and r.kv_budget_bytes == budget
    expected = {
        "contiguous/max_model_len": budget // bpt // 4096,
        "contiguous/request": budget // bpt // 2048,
        "contiguous/pow2": budget // bpt // 2048,
        "paged/bs16": budget // (16 * bpt) // 128,
        "paged/bs32": budget // (32 * bpt) // 64,
    }
    assert {k: r.max_concurrent for k, r in rows.items()} == expected
    assert expected["paged/bs16"] == 58 and expected["contiguous/max_model_len"] == 29
    for r in rows.values():
        # bytes per token x tokens reserved fits the budget, one more request does not
        assert r.max_concurrent * r.reserved_tokens * bpt <= budget
        assert (r.max_concurrent + 1) * r.reserved_tokens * bpt > budget
    assert rows["contiguous/max_model_len"].held_fraction == 0.5
    assert rows["paged/bs16"].decode_step_s > rows["contiguous/max_model_len"].decode_step_s


@pytest.mark.parametrize("section", policies([16, 48]), ids=lambda s: s.label())
def test_plan_matches_admitting_into_the_real_managers(section) -> None:
    # About 19 MiB of KV (0.5% of the memory less weights and non-torch memory): some 10,000
    # tokens of the tiny model, a few dozen requests.
    dep = Deployment(get_preset("tiny"), get_gpu("a100-40gb"), max_model_len=1024,
                     gpu_memory_utilization=0.005, max_num_batched_tokens=256, max_num_seqs=8)
    length = 300
    fits = _by_policy(plan(dep, [section], [Demand(200, 100)]))
    kv = dep.kv_manager(section)
    admitted = 0
    while True:
        req = text_request(f"r{admitted}", 200, 100)
        seq = Sequence(admitted, req, req.prompt_token_ids(4096))
        if not kv.allocate(seq, 0, length):
            break
        admitted += 1
    assert [r.max_concurrent for r in fits.values()] == [admitted]
    assert concurrency_curve(dep, section, [length]) == [admitted]


def test_capacity_scales_with_tp_and_replicas() -> None:
    p, gpu = get_preset("llama-3-70b"), get_gpu("a100-80gb")
    with pytest.raises(KvbenchError, match="tensor parallelism"):
        plan(Deployment(p, gpu, 4096, tp=1), policies([16]), [Demand(2048)])
    tp4 = _by_policy(plan(Deployment(p, gpu, 4096, tp=4), policies([16]), [Demand(2048)]))
    tp8 = _by_policy(plan(Deployment(p, gpu, 4096, tp=8), policies([16]), [Demand(2048)]))
    # Half the KV heads per rank and less weight per rank: more than twice the requests.
    assert tp8["paged/bs16"].max_concurrent > 2 * tp4["paged/bs16"].max_concurrent
    assert tp8["paged/bs16"].kv_bytes_per_token_per_rank * 8 == p.kv_bytes_per_token
    assert tp8["paged/bs16"].kv_budget_bytes == 8 * tp8["paged/bs16"].kv_budget_bytes_per_rank
    two = _by_policy(plan(Deployment(p, gpu, 4096, tp=4, num_gpus=8), policies([16]),
                          [Demand(2048)]))
    assert two["paged/bs16"].total_concurrent == 2 * tp4["paged/bs16"].max_concurrent
    with pytest.raises(KvbenchError, match="groups of 3"):
        Deployment(p, gpu, 4096, tp=3, num_gpus=8)


def test_parallel_samples_share_the_prompt_only_when_paged() -> None:
    dep = Deployment(get_preset("llama-3-8b"), get_gpu("h200"), max_model_len=8192)
    rows = _by_policy(plan(dep, policies([16]), [Demand(1024, 512, n=4)]))
    assert rows["paged/bs16"].reserved_tokens == 1024 + 4 * 512
    assert rows["contiguous/request"].reserved_tokens == 4 * 1536
    assert rows["contiguous/pow2"].reserved_tokens == 4 * 2048


def test_cli_prints_writes_csv_and_plot(tmp_path) -> None:
    out, png = tmp_path / "cap.csv", tmp_path / "cap.png"
    runner = CliRunner(env={"COLUMNS": "200"})
    result = runner.invoke(app, [
        "capacity", "--model", "llama-2-7b,mistral-7b", "--gpu", "a100-80gb", "--num-gpus", "8",
        "--seq-len", "2048", "--max-model-len", "4096", "--csv", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "paged/bs16" in result.output and "llama-2-7b" in result.output
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 10
    first = rows[0]
    assert first["policy"] == "contiguous/max_model_len" and first["max_concurrent_total"] == "232"
    assert first["paged_over_this"] == "2.0" and first["command"].startswith("kvbench ")
    result = runner.invoke(app, [
        "capacity", "--model", "qwen2.5-7b", "--gpu", "h200", "--workload", "mixed-text",
        "--plot", str(png),
    ])
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 10_000
    bad = runner.invoke(app, ["capacity", "--model", "tiny", "--gpu", "h200"])
    assert bad.exit_code != 0


@pytest.mark.parametrize("tp", [1, 2])
def test_offload_tiers_by_hand(tp: int) -> None:
    p = get_preset("qwen2.5-7b")
    dep = Deployment(p, get_gpu("h200"), max_model_len=32768, tp=tp)
    rows = plan_tiers(dep, OffloadSpec(tiers="cpu:256GiB,disk:2TiB"), [Demand(8000, 192)], 16)
    request = 512 * 16 * 28 * 2 * 4 * 128 * 2  # blocks x tokens x layers x K,V x heads x dim x 2
    assert request == 448 * 2**20
    cpu, disk = rows
    assert (cpu.sessions, disk.sessions) == (256 * 2**30 // request, 2 * 2**40 // request)
    assert cpu.sessions == 585 and cpu.sessions_per_gib == pytest.approx(2**30 / request)
    # H200: the host link is PCIe 5.0 x16 per rank, the disk NVMe gen4 (7.45 GB/s read).
    assert (cpu.link, disk.link) == ("pcie5", "nvme-gen4")
    assert cpu.load_s == pytest.approx(request / (tp * 63.0e9))
    assert disk.load_s == pytest.approx(request / (tp * 7.45e9))
    assert cpu.recompute_s == disk.recompute_s == pytest.approx(
        prefill_s(CostModel(p, get_gpu("h200"), tp), 8192, 8192))
    assert cpu.load_s < disk.load_s < cpu.recompute_s


def test_cli_offload_columns_and_refusals(tmp_path, capsys) -> None:
    out = tmp_path / "cap.csv"
    code, text = run_cli(["capacity", "--model", "qwen2.5-7b", "--gpu", "h200", "--seq-len",
                          "8192", "--kv-offload", "cpu:256GiB,disk:2TiB", "--csv", str(out)],
                         capsys)
    assert code == 0 and "Offload tiers" in text
    rows = {r["policy"]: r for r in csv.DictReader(out.open())}
    assert rows["paged/bs16"]["cpu_sessions"] == "585"
    assert rows["contiguous/request"]["cpu_sessions"] == ""
    assert float(rows["paged/bs16"]["disk_load_ms"]) > float(rows["paged/bs16"]["cpu_load_ms"])
    for args, message in ((["--kv-offload", "cpu:1GiB", "--grid", "tp=1,2"], "drop --grid"),
                          (["--kv-offload", "gpu:1GiB"], "kind 'gpu'")):
        code, text = run_cli(["capacity", "--model", "tiny", "--gpu", "h200", "--seq-len",
                              "64", *args], capsys)
        assert code == 2 and message in text and "Traceback" not in text


def test_cli_grid_one_row_per_point_and_layout(tmp_path) -> None:
    out, js = tmp_path / "grid.csv", tmp_path / "grid.json"
    runner = CliRunner(env={"COLUMNS": "250"})
    result = runner.invoke(app, [
        "capacity", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--seq-len", "2048",
        "--max-model-len", "4096", "--grid", "engine=paged,contiguous/max_model_len",
        "--grid", "replicas=1,8", "--grid", "block_size=16,32", "--grid", "gpu=a100-80gb,h200",
        "--csv", str(out), "--json", str(js),
    ])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 * 2 * 2 * 2
    by = {(r["policy"], r["replicas"], r["block_size"], r["gpu"]): r for r in rows}
    # The field report's figures: 8 x A100-80G hold 232 contiguous, 464 paged 2048-token
    # requests (29 and 58 per replica).
    assert by[("paged/bs16", "8", "16", "a100-80gb")]["max_concurrent_total"] == "464"
    assert by[("paged/bs32", "8", "32", "a100-80gb")]["max_concurrent_per_replica"] == "58"
    assert by[("contiguous/max_model_len", "8", "16", "a100-80gb")][
        "max_concurrent_total"] == "232"
    assert int(by[("paged/bs16", "1", "16", "h200")]["max_concurrent_per_replica"]) > 58
    body = json.loads(js.read_text())
    assert body["axes"]["replicas"] == ["1", "8"] and len(body["rows"]) == 16
    assert body["command"].startswith("kvbench ")
    # Every grid field alone, and a fixed KV budget.
    result = runner.invoke(app, [
        "capacity", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--grid", "seq_len=1024,4096",
        "--grid", "kv_memory=8GiB,16GiB", "--grid", "tp=1,2", "--grid", "policy=paged/bs16",
        "--grid", "max_num_seqs=64", "--grid", "gpu_memory_utilization=0.9",
        "--grid", "max_model_len=4096", "--grid", "max_num_batched_tokens=4096",
        "--grid", "model=llama-2-7b,qwen2.5-7b", "--csv", str(out),
    ])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 16
    small = [r for r in rows if r["kv_memory"] == "8GiB" and r["seq_len"] == "1024"
             and r["tp"] == "1" and r["model"] == "llama-2-7b"]
    assert small[0]["max_concurrent_per_replica"] == str(8 * 2**30 // (512 * 1024) // 1024)


@pytest.mark.parametrize(("grid", "message"), [
    ("colour=red", "capacity has no such field"),
    ("tp=0,2", "not a valid tp"),
    ("gpu=h200,b999", "not a valid gpu"),
    ("policy=paged/bs16,zigzag", "unknown KV layout"),
    ("kv_memory=lots", "not a valid kv_memory"),
    ("gpu_memory_utilization=1.5", "not a valid gpu_memory_utilization"),
    ("block_size", "use FIELD=V1,V2"),
])
def test_cli_grid_bad_field_or_value_exits_2(grid: str, message: str, capsys) -> None:
    code, out = run_cli(["capacity", "--model", "llama-2-7b", "--gpu", "a100-80gb",
                         "--seq-len", "2048", "--grid", grid], capsys)
    assert code == 2
    assert message in " ".join(out.split())
