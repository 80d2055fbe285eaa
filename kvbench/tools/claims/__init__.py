"""``kvbench claims``: one study per policy (P1-P11) and claim (C1-C26) of the field reports
(``SEED-CLAIMS.md`` beside the repository), each a measurement, a verdict by a stated rule
and the commands that reproduce it; written as ``seed-claims.md`` and ``seed-claims.json``.
"""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvbench.fileio import write_text_atomic
from kvbench.results.provenance import Measurement
from kvbench.tools.claims import claims as _claims  # noqa: F401  (registers C1-C26)
from kvbench.tools.claims import policies as _policies  # noqa: F401  (registers P1-P11)
from kvbench.tools.claims.core import STUDIES, VERDICTS, Context, Row, parse_only, run_one

__all__ = ["STUDIES", "Row", "claims_markdown", "parse_only", "run_claims"]


def run_claims(out_dir: Path, *, quick: bool, only: str | None = None,
               on_study: Callable[[str, Row], None] | None = None) -> list[Row]:
    """Run the studies (``only``: ids, comma-separated) into ``out_dir``; write the table
    and the JSON of every measurement; return the rows."""
    ids = parse_only(only)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(out_dir, quick)
    command = ("kvbench claims" + (" --quick" if quick else "")
               + (f" --only {only}" if only else "") + " -o DIR")
    measurement = Measurement(command)
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
        _write(out_dir, rows, quick, measurement, time.perf_counter() - start)
    return rows


def _write(out_dir: Path, rows: list[Row], quick: bool, measurement: Measurement,
           seconds: float) -> None:
    meta = {
        "mode": "quick" if quick else "full",
        "seconds": seconds,
        "command": measurement.command,
        "provenance": measurement.line(CLOCK_NOTE),
    }
    write_text_atomic(out_dir / "seed-claims.json", json.dumps(
        {"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1, default=str) + "\n")
    write_text_atomic(out_dir / "seed-claims.md", claims_markdown(rows, meta))


QUOTES = Path(__file__).with_name("quotes.toml")


def quotes() -> dict[str, dict[str, Any]]:
    """The reports' own words per policy and claim: ``zh`` (an excerpt of the report, in
    ``report``), ``en`` (its translation), optionally more excerpts (``zh2``/``en2``, ...,
    each in ``report2`` where it is the other report) and ``readings``."""
    return tomllib.loads(QUOTES.read_text())


def _words(quote: dict[str, Any] | None) -> str:
    if not quote:
        return "-"
    parts = [f"{quote[k]} ({quote[k.replace('zh', 'en')]})" for k in ("zh", "zh2", "zh3")
             if quote.get(k)]
    parts += [f"reading: {r}" for r in quote.get("readings", [])]
    return "<br>".join(_cell(p) for p in parts) or "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# Which figures the machine and its load could change.
CLOCK_NOTE = ("Simulated runs use the virtual clock: their figures are the same on any machine "
              "and load; wall-clock figures (C5's host timings, P11's memory spread) come from "
              "repeats and decide only where the repeats agree")


def claims_markdown(rows: list[Row], meta: dict) -> str:
    counts = {v: sum(r.verdict == v for r in rows) for v in VERDICTS}
    lines = [
        "# The field reports' policies and claims, measured",
        "",
        meta["provenance"],
        "",
        "One study per policy (P) and claim (C) of the two field reports (`SEED-CLAIMS.md`). "
        "Each verdict follows from the measured figures by the rule in its row; "
        "`misdescribed` and `not measurable here` give their reason; a claim about GPU "
        "kernels or GPU memory is not decided without a GPU's figures.",
        "",
        f"- command: `{meta['command']}` ({meta['mode']}: {meta['seconds']:.0f} s)",
        "- verdicts: " + ", ".join(f"{v} {n}" for v, n in counts.items() if n),
        "- every run's command ends in `--out runs/NAME`, relative to the output folder; "
        "`kvbench claims --only ID` redoes one row",
        "",
        "| id | claim | the report's words | interpretation tested | measured | verdict | rule "
        "| commands |",
        "|---|---|---|---|---|---|---|---|",
    ]
    words = quotes() if QUOTES.is_file() else {}
    for r in rows:
        cmds = "<br>".join(f"`{_cell(c)}`" for c in r.commands)
        # The anchor other tables link a row by: [P9: verdict](seed-claims.md#p9).
        lines.append("| " + " | ".join([
            f'<a id="{r.id.lower()}"></a>{r.id}', _cell(r.claim), _words(words.get(r.id)),
            _cell(r.interpretation), _cell(r.measured), f"**{r.verdict}**", _cell(r.rule),
            cmds]) + " |")
    return "\n".join(lines) + "\n"
