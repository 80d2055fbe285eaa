"""Regenerate the README's Quick start sample from a real run of the main job.

    python benchmarks/quickstart.py            run `kvbench run` (the embedded default), then
                                               update README.md and results/tables/default/
    python benchmarks/quickstart.py RUN_DIR    the same from an existing run folder

The block between the README's ``quickstart`` markers gets a trimmed copy of the run's table,
its "what this run shows" sentences and its fragmentation figure, stamped with the machine,
the run's wall time and the load average around it (times and throughput depend on them;
concurrency, KV and fragmentation figures do not). ``results/tables/default/`` gets the
run's summary.md and fragmentation.png.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvbench.report.findings import FINDINGS_TITLE, run_findings
from kvbench.report.tables import table_rows
from kvbench.results.schema import RunRecord, load_record
from kvbench.run.suite import load_suite

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TABLES = ROOT / "results" / "tables" / "default"
FIGURE = "fragmentation.png"
BEGIN = "<!-- quickstart: begin (benchmarks/quickstart.py writes this block) -->"
END = "<!-- quickstart: end -->"
# The rows of the run table the README keeps.
ROWS = (
    "duration (s)", "output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)",
    "max concurrent requests", "mean concurrent requests", "KV utilization (used/reserved)",
    "KV waste %", "min fragmentation index", "time a request waited for KV (s)",
    "of which with enough KV free (s)", "preemptions",
)


def render(records: list[RunRecord], stamp: str) -> str:
    """The README block: ``stamp`` says where and how the run ran."""
    lines = [BEGIN, "", stamp, "", "| metric | " + " | ".join(r.engine for r in records) + " |",
             "|---|" + "---:|" * len(records)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(records) if row[0] in ROWS]
    lines += ["", f"{FINDINGS_TITLE}:", ""]
    lines += [f"- {sentence}" for sentence in run_findings(records)]
    lines += ["", f"![free memory, its largest hole and the requests that waited]"
                  f"({TABLES.relative_to(ROOT).as_posix()}/{FIGURE})", "", END]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no block between {BEGIN!r} and {END!r}")
    return pattern.sub(lambda _: block, text)


def _stamp(records: list[RunRecord], wall_s: float | None, loads: tuple[float, float] | None
           ) -> str:
    first = records[0]
    machine = first.machine
    cores = machine.get("cpu_count")
    commit = (first.git_commit or "no git")[:12]
    text = (f"From a real run on {machine.get('cpu')} x{cores}, kvbench at commit `{commit}` on "
            f"{first.created_utc[:10]}")
    if wall_s is not None and loads is not None:
        text += (f": `kvbench run` took {wall_s:.0f} s, with a load average of {loads[0]:.1f} "
                 f"before and {loads[1]:.1f} after")
        if cores and max(loads) > cores:
            text += (f", more than its {cores} cores: other work shared the machine, so times "
                     f"and throughput are slower and noisier than on a quiet one")
    rounds = max(len(r.machine_state) for r in records)
    if rounds > 1:
        text += (f"; {rounds} rounds in alternating engine order, each engine in its own "
                 "process: values are medians, measured ones with their min-max range")
    loads_seen = [s.load_before[0] for r in records for s in r.machine_state if s.load_before]
    loads_seen += [s.load_after[0] for r in records for s in r.machine_state if s.load_after]
    if loads_seen:
        text += (f"; the 1-minute load while the engines ran was {min(loads_seen):.2f} to "
                 f"{max(loads_seen):.2f}")
    return text + "."


def main(argv: list[str]) -> None:
    wall_s = loads = None
    if argv:
        run_dir = Path(argv[0])
    else:
        # Relative, so that the command the records quote names no folder of this machine.
        run_dir = Path("runs/quickstart")
        before = os.getloadavg()[0]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kvbench.cli", "run", "--out", str(run_dir),
                        "--force"], check=True, cwd=ROOT)
        wall_s, loads = time.perf_counter() - t0, (before, os.getloadavg()[0])
        run_dir = ROOT / run_dir
    engines = load_suite(None)[0].run.engines
    records = [load_record(run_dir / f"{name}.json") for name in engines]
    TABLES.mkdir(parents=True, exist_ok=True)
    for name in ("summary.md", FIGURE):
        shutil.copyfile(run_dir / name, TABLES / name)
    README.write_text(replace_block(README.read_text(encoding="utf-8"),
                                    render(records, _stamp(records, wall_s, loads))),
                      encoding="utf-8")
    print(f"README.md and {TABLES.relative_to(ROOT)} updated from {run_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
