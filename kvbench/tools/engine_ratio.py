"""The output-throughput ratio of two engines of one engine-bound run (the built-in paged
engine over vLLM, as a rule) from their saved records.

``kvbench run --repeat N`` runs the engines in rounds (every engine once per round), so
repeat ``i`` of each engine saw the same stretch of machine time: the ratio is taken per
round and its median and spread reported, which a shared machine's drifting load disturbs
less than a ratio of medians would. An engine without a record (vLLM not installed where
the run was made, say) gives no ratio, and the report says so rather than printing one.

``python -m kvbench.tools.engine_ratio DIR [--numerator paged] [--denominator vllm]
[--json OUT]`` prints the ratio of the records in ``DIR``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.results.repeats import metric_values
from kvbench.results.schema import RunRecord, load_record

METRIC = "output_throughput"


@dataclass(frozen=True, slots=True)
class EngineRatio:
    """``numerator`` / ``denominator`` output tokens/s: ``per_round`` ratios, their
    ``median``; each engine's per-repeat tokens/s; ``missing``: why there is no ratio."""

    numerator: str
    denominator: str
    per_round: list[float]
    median: float | None
    throughputs: dict[str, list[float]]
    threads: dict[str, int | None]
    missing: str | None = None

    def line(self) -> str:
        """One line for a terminal or a job log."""
        if self.missing is not None:
            return (f"{self.numerator}/{self.denominator} output throughput: not measured: "
                    f"{self.missing}")
        tps = "; ".join(
            f"{name} {statistics.median(v):.1f} tok/s (repeats {', '.join(f'{x:.1f}' for x in v)})"
            for name, v in self.throughputs.items()
        )
        rounds = ", ".join(f"{r:.3f}" for r in self.per_round)
        threads = ", ".join(f"{k} {v}" for k, v in self.threads.items())
        return (f"{self.numerator}/{self.denominator} output throughput: {self.median:.3f}x "
                f"(per round {rounds}; min {min(self.per_round):.3f}, max "
                f"{max(self.per_round):.3f}); {tps}; CPU threads: {threads}")


def _record(folder: Path, engine: str) -> RunRecord | None:
    path = folder / f"{engine}.json"
    return load_record(path) if path.is_file() else None


def _threads(record: RunRecord) -> int | None:
    used = record.engine_config.get("cpu_threads")
    if isinstance(used, dict):
        value = used.get("at_end", used.get("at_start"))
        return value if isinstance(value, int) else None
    return None


def engine_ratio(folder: str | Path, numerator: str = "paged",
                 denominator: str = "vllm") -> EngineRatio:
    """The ratio of the records ``numerator.json`` and ``denominator.json`` in ``folder``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KvbenchError(f"{folder}: no such record folder; run `kvbench run engine-bound "
                           f"--out {folder}` first")
    records = {name: _record(folder, name) for name in (numerator, denominator)}
    throughputs: dict[str, list[float]] = {}
    threads: dict[str, int | None] = {}
    missing: list[str] = []
    for name, rec in records.items():
        if rec is None:
            hint = (": vLLM was not run (it runs only where it is installed; "
                    "`nox -s vllm -- engine-bound` runs this case with it)"
                    if name == "vllm" else "")
            missing.append(f"no {name} record in {folder}{hint}")
            continue
        if rec.status != "ok":
            missing.append(f"{name} did not finish ({rec.status}: {rec.error})")
            continue
        values = metric_values(rec, METRIC)
        if not values:
            missing.append(f"{name}'s record has no {METRIC}")
            continue
        throughputs[name] = values
        threads[name] = _threads(rec)
    if missing:
        return EngineRatio(numerator, denominator, [], None, throughputs, threads,
                           "; ".join(missing))
    num, den = throughputs[numerator], throughputs[denominator]
    if len(num) != len(den):
        return EngineRatio(numerator, denominator, [], None, throughputs, threads,
                           f"{numerator} has {len(num)} repeats, {denominator} {len(den)}: "
                           "not the rounds of one run")
    per_round = [a / b for a, b in zip(num, den, strict=True) if b > 0]
    if not per_round:
        return EngineRatio(numerator, denominator, [], None, throughputs, threads,
                           f"{denominator} produced no output tokens")
    return EngineRatio(numerator, denominator, per_round, statistics.median(per_round),
                       throughputs, threads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench.tools.engine_ratio",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="record folder of an engine-bound run")
    ap.add_argument("--numerator", default="paged")
    ap.add_argument("--denominator", default="vllm")
    ap.add_argument("--json", help="also write the ratio as JSON to this file")
    args = ap.parse_args(argv)
    try:
        ratio = engine_ratio(args.folder, args.numerator, args.denominator)
    except KvbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(ratio.line())
    if args.json:
        import json

        write_text_atomic(args.json, json.dumps(asdict(ratio), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
