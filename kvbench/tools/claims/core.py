"""The machinery of ``kvbench claims``: a row per policy or claim of the field reports, the
runs the studies share, and the verdict vocabulary.

A study is a function of a :class:`Context` returning a :class:`Row`. Its verdict comes from
its measurements through the rule the row states (``rule``), computed by a pure function of
the figures registered in :data:`RULES` (so that each can be shown to go either way); only
``misdescribed`` and ``not measurable here`` may rest on reasoning, which the row then
gives. A wall-clock figure decides only where its interleaved repeats agree (``not resolved
on this machine`` otherwise), and a claim about GPU kernels or GPU memory is not decided on
a CPU at all.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvbench.errors import KvbenchError
from kvbench.results.schema import RunRecord
from kvbench.workloads.model import Workload

if TYPE_CHECKING:
    from kvbench.run.plan import RunPlan

Verdict = Literal["reproduced", "partly", "refuted", "misdescribed", "not measurable here",
                  "not resolved on this machine"]
VERDICTS: tuple[str, ...] = ("reproduced", "partly", "refuted", "misdescribed",
                             "not measurable here", "not resolved on this machine")
NOT_RESOLVED: Verdict = "not resolved on this machine"

# What a row says of a claim about GPU kernels or GPU memory on a machine without a GPU: a
# CPU kernel at a few GB/s says nothing of how GPU paging behaves.
GPU_ONLY_RULE = ("a claim about GPU kernels or GPU memory: decided only by a GPU's figures "
                 "(benchmarks/gpu/check.sh); without them, not measurable here")


@dataclass(slots=True)
class Row:
    id: str
    claim: str  # the claim in a few words
    interpretation: str  # what is tested, units stated
    measured: str  # the figures, in words
    verdict: Verdict
    rule: str  # how the verdict follows from the figures
    commands: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # the figures, machine-readable
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"{self.id}: unknown verdict {self.verdict!r}")


Rule = Callable[..., Verdict]
# Every study's verdict rule by study id: a pure function of the figures (numbers, small
# dicts), so a test can feed it figures either side of each threshold.
RULES: dict[str, Rule] = {}


def rule(ident: str) -> Callable[[Rule], Rule]:
    """Register the decorated function as the verdict rule of study ``ident``."""
    def register(fn: Rule) -> Rule:
        if ident in RULES:
            raise RuntimeError(f"rule {ident} registered twice")
        RULES[ident] = fn
        return fn
    return register


BEST_FIRST: tuple[Verdict, ...] = ("reproduced", "partly", "refuted")


def best_of(*verdicts: Verdict) -> Verdict:
    """The most favourable of the readings' verdicts (where fair readings differ, the
    claim gets the benefit of the doubt)."""
    return min(verdicts, key=BEST_FIRST.index)


def pick(conditions: list[tuple[bool, Verdict]], otherwise: Verdict) -> Verdict:
    """The verdict of the first condition that holds."""
    return next((v for ok, v in conditions if ok), otherwise)


def decided(values: list[float], rule: Callable[[float], Verdict]) -> Verdict:
    """The verdict of a wall-clock figure's repeats: the rule's, where every repeat gives the
    same one (its range does not straddle a threshold), else ``not resolved on this
    machine``."""
    verdicts = {rule(v) for v in values}
    return verdicts.pop() if len(verdicts) == 1 else NOT_RESOLVED


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


@dataclass(slots=True)
class SuiteRun:
    """The records of one ``kvbench run`` a study made, by engine, and its command."""

    records: dict[str, RunRecord]
    command: str
    workload: Workload

    def __getitem__(self, engine: str) -> dict[str, Any]:
        return self.records[engine].summary

    def record(self, engine: str) -> RunRecord:
        return self.records[engine]


class Context:
    """What studies share: the output folder, quick or full, and runs already made (two
    studies asking for the same run get the same records)."""

    def __init__(self, out_dir: Path, quick: bool) -> None:
        self.out_dir = out_dir
        self.quick = quick
        self._runs: dict[tuple, SuiteRun] = {}
        self.cache: dict[str, Any] = {}

    def size(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    def run(self, suite: str, name: str, *, repeat: int | None = None,
            **flags: Any) -> SuiteRun:
        """``kvbench run SUITE --flag value ... [--repeat N] --out DIR/runs/NAME``, run as
        that command runs it (on the wall clock each engine in its own process, repeats in
        interleaved rounds; no figures); ``flags`` are
        :class:`~kvbench.run.overrides.RunFlags` fields."""
        from kvbench.run.execute import execute_plan

        key = ("run", suite, repeat, _flag_key(flags))
        if key not in self._runs:
            extra = [] if repeat is None else ["--repeat", str(repeat)]
            plan, command = self._plan("run", suite, name, flags, extra, repeat)
            # A failed engine's record is a study's figure too (an out-of-memory start, say).
            records = {r.engine: r for r in execute_plan(plan, plots=False)}
            self._runs[key] = SuiteRun(records, command, plan.workload)
        return self._runs[key]

    def soak(self, suite: str, name: str, *, waves: int, **flags: Any) -> SuiteRun:
        """``kvbench soak SUITE --waves N --flag value ... --out DIR/runs/NAME``: the
        workload sent ``waves`` times through one engine instance, each wave once the last
        has drained, so what an engine fails to give back accumulates (each record's
        ``soak`` holds the memory after every drain and kvbench's leak verdict)."""
        from kvbench.results.leaks import DEFAULT_NOISE_BYTES, DEFAULT_NOISE_PCT
        from kvbench.tools.soak import run_soak

        key = ("soak", suite, waves, _flag_key(flags))
        if key not in self._runs:
            plan, command = self._plan("soak", suite, name, flags, ["--waves", str(waves)])
            records = {r.engine: r for r in run_soak(plan, waves, DEFAULT_NOISE_PCT,
                                                     DEFAULT_NOISE_BYTES)}
            self._runs[key] = SuiteRun(records, command, plan.workload)
        return self._runs[key]

    def _plan(self, verb: str, suite: str, name: str, flags: dict[str, Any],
              extra: list[str], repeat: int | None = None) -> tuple[RunPlan, str]:
        """The run plan of ``kvbench VERB SUITE ...`` into ``runs/NAME`` and that command."""
        from kvbench.run.overrides import RunFlags, flag_name, resolve_suite
        from kvbench.run.plan import plan_run

        words = ["kvbench", verb, suite]
        for k, v in flags.items():
            if isinstance(v, bool):
                words.append(flag_name(k) if v else "--no-" + flag_name(k)[2:])
            else:
                words += [flag_name(k), str(v)]
        command = shlex.join([*words, *extra, "--out", f"runs/{name}"])
        the_suite, base = resolve_suite(suite, RunFlags(**flags))
        plan = plan_run(the_suite, base, self.out_dir / "runs" / name, command,
                        repeats=repeat, force=True)
        return plan, command


def _flag_key(flags: dict[str, Any]) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in flags.items()))


Study = Callable[[Context], Row]
STUDIES: dict[str, Study] = {}


def study(ident: str) -> Callable[[Study], Study]:
    def register(fn: Study) -> Study:
        if ident in STUDIES:
            raise RuntimeError(f"study {ident} registered twice")
        STUDIES[ident] = fn
        return fn
    return register


def order_key(ident: str) -> tuple[int, int]:
    return (0 if ident[0] == "P" else 1, int(ident[1:]))


def parse_only(text: str | None) -> list[str]:
    """``C1,C21,P5`` -> the study ids, checked; None -> all, in the table's order."""
    every = sorted(STUDIES, key=order_key)
    if text is None:
        return every
    wanted = [x.strip().upper() for x in text.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in STUDIES]
    if unknown or not wanted:
        raise KvbenchError(f"--only {text}: unknown ids {', '.join(unknown) or '(none)'}; "
                           f"valid: {', '.join(every)}")
    return sorted(set(wanted), key=order_key)


def run_one(ctx: Context, ident: str) -> Row:
    start = time.perf_counter()
    try:
        row = STUDIES[ident](ctx)
    except KvbenchError as exc:
        raise KvbenchError(f"study {ident}: {exc}") from None
    row.seconds = time.perf_counter() - start
    row.commands.append(f"kvbench claims --only {ident} -o DIR"
                        + (" --quick" if ctx.quick else ""))
    return row
