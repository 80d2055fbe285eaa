"""KV-budget sweeps: one run folder per budget, a table and a figure across budgets."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.errors import KvbenchError
from kvbench.results.repeats import repeat_count
from kvbench.results.schema import load_record
from kvbench.tools.sweep import parse_budgets


def test_parse_budgets_sorts_and_rejects_duplicates() -> None:
    assert parse_budgets("16MiB, 4MiB,8MiB") == ["4MiB", "8MiB", "16MiB"]
    with pytest.raises(KvbenchError, match="twice"):
        parse_budgets("1GiB,1024MiB")
    with pytest.raises(KvbenchError):
        parse_budgets(" , ")


def test_sweep_runs_each_budget_and_skips_what_cannot_fit(tmp_path, monkeypatch) -> None:
    # Per-run figures are tested in test_plots; the sweep's own figure is drawn here.
    monkeypatch.setattr("kvbench.run.execute.write_plots", lambda records, out_dir: ([], []))
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, [
        "sweep", "--kv-memory", "256MiB,1GiB,2GiB", "--device", "sim:a100-80gb",
        "--model", "llama-3-8b", "--workload", "mixed-text", "--num-requests", "16",
        "--max-model-len", "4096", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    # 256 MiB holds no 4096-token contiguous extent (512 MiB): skipped there, not fatal.
    assert not (out / "kv-256MiB" / "contiguous.json").exists()
    assert "kv-256MiB" in str(sorted(out.glob("kv-*/paged.json")))
    md = (out / "sweep.md").read_text()
    assert "256MiB contiguous" in md
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    conc = {
        (rec.engine, rec.summary["kv_capacity_bytes"]): rec.summary["max_concurrent_requests"]
        for rec in map(load_record, sorted(out.glob("kv-*/*.json")))
    }
    paged = [conc[k] for k in sorted(k for k in conc if k[0] == "paged")]
    contig = [conc[k] for k in sorted(k for k in conc if k[0] == "contiguous")]
    assert len(paged) == 3 and len(contig) == 2
    assert paged == sorted(paged) and contig == sorted(contig)
    assert contig == [2, 4]  # 1 GiB and 2 GiB hold 2 and 4 extents of 512 MiB


def test_parse_block_sizes_sorts_and_rejects_bad_values() -> None:
    from kvbench.tools.sweep import parse_block_sizes

    assert parse_block_sizes("64, 8,16") == [8, 16, 64]
    for bad in ("8,8", "0,16", "16k", " , "):
        with pytest.raises(KvbenchError):
            parse_block_sizes(bad)


def test_sweep_over_block_sizes_runs_each_and_draws_the_trade_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("kvbench.run.execute.write_plots", lambda records, out_dir: ([], []))
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, [
        "sweep", "--block-size", "16,64,256", "--device", "sim:a100-80gb",
        "--model", "llama-3-8b", "--workload", "mixed-text", "--num-requests", "24",
        "--kv-memory", "1GiB", "--engines", "paged,contiguous", "--repeat", "2",
        "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert all(repeat_count(load_record(p)) == 2 for p in out.glob("*/*.json"))
    # One budget and three block sizes: a run folder per combination.
    assert sorted(p.parent.name for p in out.glob("*/paged.json")) == [
        "kv-1GiB-bs-16", "kv-1GiB-bs-256", "kv-1GiB-bs-64"]
    recs = {rec.engine_config.get("block_size"): rec.summary
            for rec in map(load_record, sorted(out.glob("*/paged.json")))}
    # Larger blocks leave more of each sequence's last block empty.
    assert recs[16]["kv_waste_pct"] < recs[64]["kv_waste_pct"] < recs[256]["kv_waste_pct"]
    md = (out / "sweep.md").read_text()
    assert "| engine | KV budget | block size |" in md and "| paged | 1.0 GiB | 256 |" in md
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
