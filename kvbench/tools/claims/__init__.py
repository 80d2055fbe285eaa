"""``kvbench claims``: one study per policy (P1-P11) and claim (C1-C26) of the field reports
(``SEED-CLAIMS.md`` beside the repository), each a measurement, a verdict by a stated rule
and the commands that reproduce it; written as ``seed-claims.md`` and ``seed-claims.json``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from kvbench.fileio import write_text_atomic
from kvbench.run.machine import git_commit
from kvbench.tools.claims import claims as _claims  # noqa: F401  (registers C1-C26)
from kvbench.tools.claims import policies as _policies  # noqa: F401  (registers P1-P11)
from kvbench.tools.claims.core import STUDIES, VERDICTS, Context, Row, parse_only, run_one

__all__ = ["STUDIES", "Row", "claims_markdown", "parse_only", "run_claims"]


def _load() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def run_claims(out_dir: Path, *, quick: bool, only: str | None = None,
               on_study: Callable[[str, Row], None] | None = None) -> list[Row]:
    """Run the studies (``only``: ids, comma-separated) into ``out_dir``; write the table
    and the JSON of every measurement; return the rows."""
    ids = parse_only(only)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(out_dir, quick)
    load_before = _load()
    start = time.perf_counter()
    rows: list[Row] = []
    try:
        for ident in ids:
            row = run_one(ctx, ident)
            rows.append(row)
            if on_study:
                on_study(ident, row)
    finally:
        # A failed or interrupted study still leaves the rows before it.
        _write(out_dir, rows, quick, only, start, load_before)
    return rows


def _write(out_dir: Path, rows: list[Row], quick: bool, only: str | None, start: float,
           load_before: str) -> None:
    meta = {
        "mode": "quick" if quick else "full",
        "seconds": time.perf_counter() - start,
        "load_before": load_before,
        "load_after": _load(),
        "machine": _machine(),
        "command": "kvbench claims" + (" --quick" if quick else "")
                   + (f" --only {only}" if only else "") + " -o DIR",
    }
    write_text_atomic(out_dir / "seed-claims.json", json.dumps(
        {"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1, default=str) + "\n")
    write_text_atomic(out_dir / "seed-claims.md", claims_markdown(rows, meta))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _machine() -> str:
    from kvbench.run.machine import machine_info

    info = machine_info()
    return (f"{info['cpu']}, {info['cpu_count']} CPUs, Python {info['python']}, torch "
            f"{info['versions'].get('torch')}, commit {(git_commit() or 'unknown')[:12]}")


def _busy(meta: dict) -> str:
    """A clause saying the timings were taken under load, when the load average (before or
    after) exceeded the CPUs."""
    try:
        loads = [float(meta[k].split(" / ")[0]) for k in ("load_before", "load_after")]
        cpus = int(meta["machine"].split(" CPUs")[0].rsplit(", ", 1)[-1])
    except (KeyError, ValueError, IndexError):
        return ""
    if max(loads) <= cpus:
        return ""
    return (f", under load (load average up to {max(loads):.1f} on {cpus} CPUs: other work "
            "shared the machine, so they are slower and noisier than on a quiet one; "
            "rerun the command there to redo them)")


def claims_markdown(rows: list[Row], meta: dict) -> str:
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    lines = [
        "# The field reports' policies and claims, measured",
        "",
        "One study per policy (P) and claim (C) of the two field reports (`SEED-CLAIMS.md`). "
        "Each verdict follows from the measured figures by the rule in its row; "
        "`misdescribed` and `not measurable here` give their reason. Simulated runs use the "
        "virtual clock (identical on any machine); CPU timings (P9, C5, C9, C12, C13, C14) "
        "are medians taken on the machine below" + _busy(meta) + ".",
        "",
        f"- command: `{meta['command']}` ({meta['mode']}: {meta['seconds']:.0f} s)",
        f"- machine: {meta['machine']}; load average (1/5/15 min) {meta['load_before']} "
        f"before, {meta['load_after']} after",
        "- verdicts: " + ", ".join(f"{v} {n}" for v, n in counts.items() if n),
        "- every run's command ends in `--out runs/NAME`, relative to the output folder; "
        "`kvbench claims --only ID` redoes one row",
        "",
        "| id | claim | interpretation tested | measured | verdict | rule | commands |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cmds = "<br>".join(f"`{_cell(c)}`" for c in r.commands)
        lines.append("| " + " | ".join([
            r.id, _cell(r.claim), _cell(r.interpretation), _cell(r.measured),
            f"**{r.verdict}**", _cell(r.rule), cmds]) + " |")
    return "\n".join(lines) + "\n"
