"""Parameter grids: a suite run at every point of ``--grid field=v1,v2`` axes (their
cartesian product), the points in parallel on local processes or as Ray tasks.

A point is the suite with one value per axis set, planned and run on its own in a worker;
its records come back to this process, which writes them under ``out_dir/<point>/``. Under
the virtual clock a point's records do not depend on where or alongside what it ran, so a
grid's records equal a serial run's. A point that fails (bad value, engine error, a lost
worker) becomes a failed record saying why; the grid goes on.

A field is a suite path (``run.block_size``, ``cluster.router``, ``engines.NAME.FIELD``)
or a run flag's name (``block_size``, ``replicas``, ``kv_memory``, ``model``, ...);
``engine`` runs one engine per point.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import itertools
import math
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from kvbench import __version__
from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.results.knee import kv_pressure_knee, saturation_curve
from kvbench.results.schema import RunRecord, WorkloadInfo
from kvbench.run.overrides import RunFlags
from kvbench.run.suite import Suite
from kvbench.tools.sweep import summary_cell
from kvbench.workloads.validation import validation_message

Backend = Literal["local", "ray"]
# Short names: every run flag's target, and one engine per point.
_ALIASES: dict[str, str] = {f.name: f.metadata["target"] for f in fields(RunFlags)}
_ALIASES |= {"engine": "run.engines", "model": "model.preset", "seed": "workload.seed",
             "num_requests": "workload.num_requests"}


@dataclass(frozen=True, slots=True)
class Axis:
    path: str  # the suite path it sets
    name: str  # as the user wrote it
    values: tuple[str, ...]


def split_axis(text: str) -> tuple[str, tuple[str, ...]]:
    """``field=v1,v2,...`` as the field's name and its values (``--grid`` syntax)."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    values = tuple(v.strip() for v in rest.split(",") if v.strip())
    if not sep or not name or not values:
        raise KvbenchError(f"--grid {text!r}: use FIELD=V1,V2,... e.g. block_size=8,16,32")
    if len(set(values)) != len(values):
        raise KvbenchError(f"--grid {text!r} lists a value twice")
    return name, values


def parse_axis(text: str) -> Axis:
    """``field=v1,v2,...`` (``--grid``)."""
    name, values = split_axis(text)
    path = _ALIASES.get(name.replace("-", "_"), name)
    if path == "workload":
        raise KvbenchError(f"--grid {name}: workloads are not a grid field; give a suite per "
                           "workload")
    parts = path.split(".")
    if len(parts) not in (2, 3) or parts[0] not in Suite.model_fields or (
        len(parts) == 3 and parts[0] != "engines"
    ):
        raise KvbenchError(
            f"--grid {name}: not a suite field; give a run flag's name (block_size, "
            "replicas, kv_memory, ...), engine, or a suite path such as run.max_num_seqs, "
            "cluster.router or engines.NAME.FIELD"
        )
    return Axis(path, name, values)


@dataclass(frozen=True, slots=True)
class Point:
    index: int
    values: tuple[tuple[str, str], ...]  # (axis name, value)

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.values)

    @property
    def folder(self) -> str:
        safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in self.label)
        return f"p{self.index:03d}-{safe.replace('=', '-').replace(',', '_')}"[:120]


# A grid is the product of its axes, so a few long ones make more points than anyone meant
# to run; past this many, the grid runs only when asked again (--yes).
MAX_GRID_POINTS = 10_000
# Points are CPU-bound: workers beyond this many per core only contend for the cores, and
# each is a process with its own interpreter and imports.
WORKERS_PER_CORE = 2


class AxisLike(Protocol):
    """A grid axis of any command: its name as the user wrote it, and its values."""

    @property
    def name(self) -> str: ...

    @property
    def values(self) -> tuple[Any, ...]: ...


def check_grid_size(axes: Sequence[AxisLike], yes: bool) -> int:
    """The number of points of ``axes``, counted without listing them; above
    ``MAX_GRID_POINTS`` a KvbenchError unless ``yes``."""
    n = math.prod(len(a.values) for a in axes)
    if n > MAX_GRID_POINTS and not yes:
        shape = " x ".join(f"{a.name} {len(a.values):,}" for a in axes)
        raise KvbenchError(
            f"the grid has {n:,} points ({shape}), more than {MAX_GRID_POINTS:,}: give "
            "fewer values, or --yes to run them all"
        )
    return n


def local_workers(requested: int, points: int) -> tuple[int, str | None]:
    """The worker processes a grid of ``points`` runs on locally: ``requested``, but at
    most one per point and ``WORKERS_PER_CORE`` per core; with a note when fewer."""
    if requested < 1:
        raise KvbenchError(f"--workers must be at least 1, not {requested}")
    cores = os.cpu_count() or 1
    cap = min(points, WORKERS_PER_CORE * cores)
    if requested <= cap:
        return requested, None
    why = (f"one per point of {points}" if cap == points
           else f"{WORKERS_PER_CORE} per core on {cores} cores")
    return cap, f"--workers {requested:,}: running {cap} worker processes ({why})"


def grid_points(axes: Sequence[Axis]) -> list[Point]:
    if len({a.path for a in axes}) != len(axes):
        raise KvbenchError("--grid names the same field twice")
    combos = itertools.product(*[[(a.name, v) for v in a.values] for a in axes])
    return [Point(i, tuple(c)) for i, c in enumerate(combos)]


def point_suite(suite: Suite, axes: Sequence[Axis], point: Point) -> Suite:
    """``suite`` with the point's values set, validated as if written in the suite file."""
    data = suite.model_dump()
    for axis, (_, value) in zip(axes, point.values, strict=True):
        parts = axis.path.split(".")
        if parts[0] == "engines":
            section = data["engines"].get(parts[1])
            if section is None:
                if parts[1] not in suite.run.engines:
                    raise KvbenchError(f"--grid {axis.name}: the suite has no engine "
                                       f"{parts[1]!r}")
                named = suite.engine(parts[1])
                section = {"kind": named.kind, **named.model_dump(exclude_unset=True)}
                data["engines"][parts[1]] = section
            section[parts[2]] = value
        elif axis.path == "run.engines":
            data["run"]["engines"] = [value]
        else:
            data[parts[0]][parts[1]] = value
    try:
        return type(suite).model_validate(data)
    except ValidationError as exc:
        raise KvbenchError(f"grid point {point.label}: {validation_message(exc)}") from None


@dataclass(slots=True)
class PointResult:
    point: Point
    records: list[RunRecord] = field(default_factory=list)
    error: str | None = None
    warnings: list[str] = field(default_factory=list)


def run_point(suite_data: dict[str, Any], base: str | None, command: str) -> dict[str, Any]:
    """Plan and run one point (in a worker process or a Ray task): its records as JSON and
    the plan's warnings, or the error that stopped it. Nothing is written where it runs."""
    from kvbench.run.execute import execute_plan
    from kvbench.run.plan import plan_run

    tmp = tempfile.mkdtemp(prefix="kvbench-point-")
    try:
        suite = Suite.model_validate(suite_data)
        plan = plan_run(suite, Path(base) if base else None, Path(tmp) / "run", command)
        records = execute_plan(plan, plots=False)
        return {"records": [r.to_json() for r in records], "warnings": plan.warnings}
    except KvbenchError as exc:
        return {"error": str(exc)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def failed_record(suite: Suite, point: Point, error: str, command: str) -> RunRecord:
    """The record a point that never produced one leaves: status failed, the error."""
    return RunRecord(
        kvbench_version=__version__, git_commit=None,
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), machine={},
        command=command, suite=suite.name,
        workload=WorkloadInfo(name="(not loaded)", digest="", source="", seed=suite.workload.seed,
                              num_requests=0, prompt_tokens=0, output_tokens=0),
        engine=",".join(suite.run.engines), engine_config={"grid_point": point.label},
        model={"name": suite.model.preset}, device=suite.run.device, clock=suite.run.clock,
        status="failed", error=f"grid point {point.label}: {error}", summary={}, curves={},
        requests=[],
    )


@dataclass(slots=True)
class GridResult:
    axes: list[Axis]
    points: list[PointResult]
    wall_s: float = 0.0
    backend: str = "local"
    workers: int = 1

    @property
    def records(self) -> list[RunRecord]:
        return [r for p in self.points for r in p.records]

    @property
    def failed(self) -> int:
        return sum(p.error is not None or any(r.status != "ok" for r in p.records)
                   for p in self.points)


Progress = Callable[[int, int], None]  # (points done, points failed)


def run_grid(
    suite: Suite,
    base: Path | None,
    axes: Sequence[Axis],
    out_dir: Path,
    command: str,
    *,
    workers: int = 1,
    backend: Backend = "local",
    address: str | None = None,
    on_point: Progress | None = None,
    yes: bool = False,
) -> GridResult:
    """Run every point of ``axes`` over ``suite`` (see the module docstring); write each
    point's records under ``out_dir`` and a table of all of them, ``grid.md``. More than
    ``MAX_GRID_POINTS`` points run only with ``yes``; ``workers`` is capped as
    :func:`local_workers` says."""
    import time

    workers = local_workers(workers, check_grid_size(axes, yes))[0]
    points = grid_points(axes)
    suites: dict[int, Suite] = {}
    results: dict[int, PointResult] = {}
    for p in points:
        try:
            suites[p.index] = point_suite(suite, axes, p)
        except KvbenchError as exc:
            results[p.index] = PointResult(p, [failed_record(suite, p, str(exc), command)],
                                           error=str(exc))
    base_s = str(base.resolve()) if base is not None else None
    jobs = {i: (s.model_dump(mode="json"), base_s, command) for i, s in suites.items()}
    t0 = time.perf_counter()
    done = [len(results), len(results)]  # points done, failed

    def finished(i: int, payload: dict[str, Any]) -> None:
        p = points[i]
        if "error" in payload:
            res = PointResult(p, [failed_record(suites[i], p, payload["error"], command)],
                              error=payload["error"])
        else:
            recs = [RunRecord.model_validate_json(text) for text in payload["records"]]
            res = PointResult(p, recs, warnings=payload.get("warnings", []))
        results[i] = res
        _write_point(out_dir / p.folder, res)
        done[0] += 1
        done[1] += res.error is not None or any(r.status != "ok" for r in res.records)
        if on_point is not None:
            on_point(done[0], done[1])

    if on_point is not None:
        on_point(done[0], done[1])
    for i, res in results.items():
        _write_point(out_dir / points[i].folder, res)
    if backend == "ray":
        _run_ray(jobs, finished, address)
    elif workers == 1:
        for i, job in jobs.items():
            finished(i, run_point(*job))
    else:
        _run_local(jobs, finished, workers)
    result = GridResult(list(axes), [results[p.index] for p in points],
                        time.perf_counter() - t0, backend, workers)
    write_text_atomic(out_dir / "grid.md", grid_markdown(result, command))
    return result


def _run_local(jobs: dict[int, tuple], finished: Callable[[int, dict], None],
               workers: int) -> None:
    with cf.ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_point, *job): i for i, job in jobs.items()}
        for fut in cf.as_completed(futures):
            try:
                payload = fut.result()
            except Exception as exc:  # the worker died (killed, out of memory)
                payload = {"error": f"worker lost: {type(exc).__name__}: {exc}"}
            finished(futures[fut], payload)


def _run_ray(jobs: dict[int, tuple], finished: Callable[[int, dict], None],
             address: str | None) -> None:
    try:
        import ray
    except ImportError:
        raise KvbenchError("--backend ray needs Ray: pip install -e '.[ray]'") from None
    started = not ray.is_initialized()
    if started:
        if address is None:
            # Ray lowers its workers' priority by default; on a busy machine the points then
            # barely run. A local instance started for the grid runs them at normal priority.
            os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(run_point)
        refs = {task.remote(*job): i for i, job in jobs.items()}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    payload = ray.get(ref)
                except Exception as exc:  # the task's worker died
                    payload = {"error": f"Ray task lost: {type(exc).__name__}: {exc}"}
                finished(refs[ref], payload)
    finally:
        if started:
            ray.shutdown()


def _write_point(folder: Path, res: PointResult) -> None:
    from kvbench.report.tables import summary_markdown

    for rec in res.records:
        rec.write(folder / f"{rec.engine.replace(',', '+') or 'point'}.json")
    write_text_atomic(folder / "summary.md", summary_markdown(res.records))


GRID_COLUMNS: list[tuple[str, str]] = [
    ("completed", "done"),
    ("max_concurrent_requests", "max conc."),
    ("mean_concurrent_requests", "mean conc."),
    ("preemptions", "preempt."),
    ("prefix_hit_rate", "prefix hit"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
]


def _engine_column(result: GridResult) -> bool:
    return all(a.path != "run.engines" for a in result.axes)


def grid_rows(result: GridResult) -> list[list[str]]:
    rows = []
    engine = _engine_column(result)
    for p in result.points:
        for rec in p.records:
            row = [*[v for _, v in p.point.values], *([rec.engine] if engine else []),
                   rec.status if rec.status == "ok" else f"{rec.status}: "
                   f"{(rec.error or '').splitlines()[0][:80]}"]
            row += [summary_cell(k, rec.summary.get(k)) for k, _ in GRID_COLUMNS]
            rows.append(row)
    return rows


def grid_header(result: GridResult) -> list[str]:
    engine = ["engine"] if _engine_column(result) else []
    return [*[a.name for a in result.axes], *engine, "status", *[h for _, h in GRID_COLUMNS]]


def rate_knees(result: GridResult) -> list[str]:
    """With a request-rate axis: the KV-pressure knee of every curve along it (one per
    engine and combination of the other axes)."""
    rate_axis = next((k for k, a in enumerate(result.axes) if a.path == "run.request_rate"),
                     None)
    if rate_axis is None:
        return []
    curves: dict[tuple, list[tuple[float, RunRecord]]] = {}
    for p in result.points:
        rate = float(p.point.values[rate_axis][1])
        others = tuple(v for k, v in enumerate(p.point.values) if k != rate_axis)
        for rec in p.records:
            curves.setdefault((*others, rec.engine), []).append((rate, rec))
    out = []
    for key, runs in curves.items():
        knee = kv_pressure_knee(saturation_curve(runs))
        where = ", ".join(f"{n}={v}" for n, v in zip(
            [a.name for k, a in enumerate(result.axes) if k != rate_axis], key[:-1],
            strict=True))
        out.append(f"{key[-1]}{' (' + where + ')' if where else ''}: {knee.finding}")
    if out:
        out.append(f"method: {kv_pressure_knee([]).method}")
    return out


def grid_markdown(result: GridResult, command: str) -> str:
    header = grid_header(result)
    shape = " x ".join(f"{a.name}: {len(a.values)}" for a in result.axes)
    lines = [
        "# kvbench grid",
        "",
        f"- command: `{command}`",
        f"- {len(result.points)} points ({shape}), "
        f"{result.failed} failed; backend {result.backend}"
        + (f", {result.workers} workers" if result.backend == "local" else "")
        + f"; wall time {result.wall_s:.1f} s",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * (len(header) - len(GRID_COLUMNS)) + "---:|" * len(GRID_COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in grid_rows(result)]
    knees = rate_knees(result)
    if knees:
        lines += ["", "## KV-pressure knee along request_rate", ""] + [f"- {k}" for k in knees]
    return "\n".join(lines) + "\n"
