"""Publishes fidelity checks: ``python -m kvbench.tools.fidelity.publish DIR... --tables
results/tables --keep results/fidelity``.

Each check's table and figure go to ``TABLES/fidelity-<engine>-<device>.md|.png``, and
``TABLES/fidelity.md`` gets the headline rows of all of them with their measurement stamps,
and ``--notes`` under them.
With ``--keep``, what the simulated half needs of each check's real runs (plan, peak
figures, the calibration steps, each load's record and steps; no sweep runs, no curves) is
copied to ``KEEP/<engine>-<device>/real/``, where ``kvbench fidelity --resimulate`` and asv
read it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.fileio import read_text, write_bytes_atomic, write_text_atomic
from kvbench.tools.fidelity.errors import goal_pct
from kvbench.tools.fidelity.report import figure_png, markdown
from kvbench.tools.fidelity.study import CALIBRATION


def _name(result: dict[str, Any]) -> str:
    spec = result["spec"]
    return f"{spec['engine']}-{spec['device'].replace(':', '')}"


def headline(checks: list[tuple[str, dict[str, Any]]]) -> str:
    """The index page: per check, workload and load, the median (p90) per-request errors of
    the kept structure, preemptions real → simulated, the goal, and a second real run's
    error against the first (the machine's noise)."""
    out = ["# Sim-to-real fidelity", "",
           "How far kvbench's simulator is from real engines, request by request: the "
           "median (p90) absolute percentage error of each request's latency, simulated "
           "against measured, with the cost model fitted on another workload's real run. "
           "Each engine's page has every figure, the structures of the step cost compared, "
           "and the figure. How it is measured: the docs' *Sim-to-real fidelity* page.", ""]
    for page, result in checks:
        spec = result["spec"]
        out += [f"## {spec['engine']} on {spec['device']} ([every figure]({page}))", "",
                result["stamp"], "",
                f"Model {spec['model']}, {spec['num_requests']} requests per run, KV "
                f"{spec['kv_memory']}, block size {spec['block_size']}; structure kept: "
                f"{result['form']}.", "",
                "| workload | load | req/s | TTFT | TPOT | E2E | preemptions real → sim | goal "
                "| real vs real: TTFT / TPOT / E2E |",
                "|---|---|---|---|---|---|---|---|---|"]
        for wl in result["workloads"]:
            for lv in wl["levels"]:
                kept = lv["forms"][result["form"]]
                e, pre = kept["requests"], kept["run"]["preemptions"]
                cells = [f"{e[k]['median_ape_pct']:.1f}% ({e[k]['p90_ape_pct']:.1f}%)"
                         for k in ("ttft", "tpot", "e2el")]
                missed = lv["misses"]
                goal = f"≤ {goal_pct(lv['load']):.0f}%: " + ("met" if not missed else
                                                             "missed")
                noise = lv.get("noise")
                floor = (" / ".join(f"{noise[k]['median_ape_pct']:.1f}%" for k in noise)
                         if noise else "–")
                out.append(f"| {wl['workload']} | {lv['load']:.0%} | {lv['rate']:.2f} | "
                           f"{' | '.join(cells)} | {pre['real']} → {pre['sim']} | {goal} | "
                           f"{floor} |")
        out.append("")
    return "\n".join(out)


def keep_real(src: Path, dest: Path) -> None:
    """What the simulated half reads of ``src``'s real runs, records without their curves."""
    plan = json.loads(read_text(src / "plan.json", "fidelity plan (.json)"))
    engine = plan["spec"]["engine"]
    runs = [*CALIBRATION] + [lv["run"] for wl in plan["workloads"] for lv in wl["levels"]]
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in ("plan.json", "peaks.json"):
        shutil.copy(src / name, dest / name)
    for run in runs:
        (dest / run).mkdir()
        shutil.copy(src / run / "steps.json", dest / run / "steps.json")
        _without_curves(src / run / f"{engine}.json", dest / run)
        if (src / f"{run}-again").is_dir():
            (dest / f"{run}-again").mkdir()
            _without_curves(src / f"{run}-again" / f"{engine}.json", dest / f"{run}-again")


def _without_curves(record: Path, dest: Path) -> None:
    if record.exists():
        data = json.loads(read_text(record))
        data["curves"] = {}
        write_text_atomic(dest / record.name, json.dumps(data) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.tools.fidelity.publish",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checks", nargs="+", type=Path, help="output folders of kvbench fidelity")
    parser.add_argument("--tables", type=Path, required=True)
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--notes", type=Path, help="Markdown put under the headline rows: "
                        "where the goal was missed, and why")
    args = parser.parse_args(argv)
    checks = []
    for folder in args.checks:
        if not (folder / "fidelity.json").is_file():
            raise KvbenchError(f"{folder} holds no fidelity.json: run kvbench fidelity -o "
                               f"{folder} first")
        result = json.loads(read_text(folder / "fidelity.json"))
        name = f"fidelity-{_name(result)}"
        write_text_atomic(args.tables / f"{name}.md",
                          markdown(result, result["stamp"], f"{name}.png"))
        write_bytes_atomic(args.tables / f"{name}.png", figure_png(result))
        checks.append((f"{name}.md", result))
        if args.keep is not None:
            keep_real(folder / "real", args.keep / _name(result) / "real")
    notes = read_text(args.notes, "notes (.md)") if args.notes else ""
    write_text_atomic(args.tables / "fidelity.md", headline(checks) + "\n" + notes)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KvbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
