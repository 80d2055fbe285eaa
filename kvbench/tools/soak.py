"""Soak runs: each engine drives the workload in repeated waves through one engine instance,
so anything it fails to give back accumulates; the records carry the per-wave memory and the
leak verdict (rules in ``kvbench.results.leaks``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.report.plots import plot_soak, write_plots
from kvbench.report.tables import summary_markdown
from kvbench.results.leaks import KV_KIND, analyze_soak
from kvbench.results.schema import RunRecord
from kvbench.run.execute import record_of, record_unstarted, start_and_run
from kvbench.run.harness import OnProgress
from kvbench.run.plan import RunPlan
from kvbench.units import format_bytes


def run_soak(
    plan: RunPlan,
    waves: int,
    noise_pct: float,
    noise_bytes: int,
    on_engine: Callable[[str], OnProgress | None] | None = None,
) -> list[RunRecord]:
    """Soak every engine of ``plan`` in turn; records, summary and figures go to its out dir."""
    if waves < 2:
        raise KvbenchError(f"a soak needs at least 2 waves to fit growth per wave, got {waves}")
    records = []
    for name, engine in plan.engines:
        progress = on_engine(name) if on_engine else None
        run, config = start_and_run(plan, engine, progress, waves=waves)
        record = record_of(plan, run, config, soak=analyze_soak(run, noise_pct, noise_bytes))
        record.write(plan.out_dir / f"{name}.json")
        records.append(record)
        if run.status == "interrupted":
            records += record_unstarted(
                plan, {r.engine for r in records}, f"not started: the run was {run.error}"
            )
            break
    write_text_atomic(plan.out_dir / "summary.md", soak_markdown(records))
    plan.warnings += write_plots(records, plan.out_dir, extra=[("soak.png", plot_soak)])[1]
    return records


def _mem(rec: RunRecord, kind: str, index: int) -> str:
    waves = rec.soak.per_wave if rec.soak else []
    return format_bytes(waves[index].memory.get(kind)) if waves else "-"


def soak_rows(records: Sequence[RunRecord]) -> list[list[str]]:
    """Per engine: waves, KV and RSS after the first and last wave, growth, verdict."""
    rows = []
    for rec in records:
        soak = rec.soak
        if soak is None:
            continue
        kv = soak.fits.get(KV_KIND)
        rss = soak.fits.get("rss_bytes")
        rows.append([
            rec.engine,
            f"{soak.waves_completed}/{soak.waves}",
            f"{_mem(rec, KV_KIND, 0)} → {_mem(rec, KV_KIND, -1)}",
            format_bytes(kv.bytes_per_wave) if kv else "-",
            f"{_mem(rec, 'rss_bytes', 0)} → {_mem(rec, 'rss_bytes', -1)}",
            format_bytes(rss.bytes_per_wave) if rss else "-",
            "-" if soak.memory_growth_pct is None else f"{soak.memory_growth_pct:.1f}",
            "LEAK" if soak.leak_detected else "no leak",
        ])
    return rows


SOAK_HEADER = [
    "engine", "waves", "KV after drain", "KV / wave", "RSS after drain", "RSS / wave",
    "growth %", "verdict",
]


def soak_findings(records: Sequence[RunRecord]) -> list[str]:
    return [f"{r.engine}: {f}" for r in records if r.soak for f in r.soak.findings]


def soak_markdown(records: Sequence[RunRecord]) -> str:
    lines = [summary_markdown(records), "## Soak: memory left after each wave drained", ""]
    lines += ["| " + " | ".join(SOAK_HEADER) + " |", "|---" * len(SOAK_HEADER) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in soak_rows(records)]
    lines += [""] + [f"- {f}" for f in soak_findings(records)]
    first = next((r.soak for r in records if r.soak), None)
    if first is not None:
        lines += [
            "",
            "Memory after drain: first wave → last wave. "
            "KV growth after a drain is a leak (deterministic); RSS and device memory count "
            f"as leaking when their fitted growth exceeds {first.noise_pct:g}% of the first "
            f"wave's reading and {format_bytes(first.noise_bytes)}.",
        ]
    return "\n".join(lines) + "\n"
