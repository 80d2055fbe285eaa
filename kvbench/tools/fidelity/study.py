"""A fidelity check: calibrate the cost model on one workload's real runs, then run other
workloads both for real and in simulation with the fitted profile, at loads relative to the
real engine's measured capacity, and compare request by request.

Layout of the output folder:

- ``real/<run>/`` the real runs: each a record and ``steps.json`` (every step's batch shape,
  measured seconds and the run loop's gap before it); ``profile-<form>.json`` the profiles
  fitted on the calibration runs;
- ``sim/<form>/<run>/`` the simulated runs, one folder per structure of the step cost;
- ``fidelity.json`` every error, ``fidelity.md`` the table, ``fidelity.png`` the figure.

The real runs go one after another, each in its own process as ``kvbench run`` runs it (the
calibration runs first); the simulated half is deterministic and can be done again from the
folder alone (:func:`resimulate`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.engines.sim.costmodel import CostModel
from kvbench.errors import KvbenchError
from kvbench.results.schema import RunRecord
from kvbench.tools.calibrate.fit import features, fit_forms, holdout_mask
from kvbench.tools.calibrate.profile import FitSummary, Profile, load_profile, save_profile
from kvbench.tools.fidelity.errors import (
    matched_requests,
    misses,
    request_errors,
    run_errors,
    step_errors,
)
from kvbench.tools.fidelity.steps import StepSample, StepTap

Say = Callable[[str], None]
# The calibration workload's two real runs: every request at once, then Poisson arrivals at
# the throughput the first reached. A batch that changes as requests come and go costs more
# per step than a steady one of the same shape (vLLM's by 5-10% on a CPU), so the fit sees
# both.
CALIBRATION = ("calibration", "calibration-paced")


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """What to check. ``engine`` is the real engine (a built-in policy or ``vllm``); the
    simulation runs the built-in engine with the same policy (``paged`` for vLLM)."""

    engine: str = "paged"
    device: str = "cpu"
    model: str = "tiny"
    calibration: str = "mixed-text"
    validation: tuple[str, ...] = ("mixed-text",)
    num_requests: int = 40
    loads: tuple[float, ...] = (0.5, 0.8, 1.2)
    # Request rates of the capacity sweep besides all-at-once, as multiples of the
    # all-at-once throughput; the capacity is the most any point sustained.
    sweep: tuple[float, ...] = (0.75, 1.0)
    kv_memory: str = "4MiB"
    block_size: int = 16
    max_model_len: int = 2048
    seed: int = 0
    cpu_threads: int | None = None
    # Each load's real run once more, to measure how far a real run is from itself: the
    # error below which the simulator's cannot be told apart from the machine's noise.
    repeat_real: bool = True

    @property
    def sim_engine(self) -> str:
        return "paged" if self.engine == "vllm" else self.engine

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def slug(text: str) -> str:
    """A folder name for a workload or form: ``azure:…/llm_conv.csv`` -> ``azure-llm-conv``."""
    stem = Path(text.split(":", 1)[-1]).stem if ":" in text else text
    kind = text.split(":", 1)[0] + "-" if ":" in text else ""
    return re.sub(r"[^a-z0-9]+", "-", (kind + stem).lower()).strip("-")


def _flags(spec: Spec, workload: str, rate: float, *, seed: int, sim: Path | None
           ) -> dict[str, Any]:
    """RunFlags of one run; ``sim``: the profile to simulate with, else the real device."""
    flags: dict[str, Any] = dict(
        engines=spec.sim_engine if sim else spec.engine, workload=workload,
        num_requests=spec.num_requests, seed=seed, model=spec.model,
        device=f"sim:{sim}" if sim else spec.device, clock="virtual" if sim else "wall",
        kv_memory=spec.kv_memory, block_size=spec.block_size,
        max_model_len=spec.max_model_len, request_rate=rate,
    )
    if spec.cpu_threads is not None and not sim:
        flags["cpu_threads"] = spec.cpu_threads
    return flags


def _plan(flags: dict[str, Any], out: Path):
    from kvbench.run.overrides import RunFlags, flag_name, resolve_suite
    from kvbench.run.plan import plan_run

    words = ["kvbench", "run", "quick-cpu"]
    for k, v in flags.items():
        words += [flag_name(k), str(v)]
    command = shlex.join([*words, "--out", str(out)])
    suite, base = resolve_suite("quick-cpu", RunFlags(**flags))
    return plan_run(suite, base, out, command, repeats=1, force=True)


def real_run(spec: Spec, workload: str, rate: float, out: Path, seed: int
             ) -> tuple[RunRecord, StepSample]:
    """One real run as ``kvbench run`` makes it (in its own process on the wall clock), its
    steps observed; the record and ``steps.json`` are written to ``out``."""
    from kvbench.run.execute import execute_plan

    plan = _plan(_flags(spec, workload, rate, seed=seed, sim=None), out)
    path = out / "steps.json"
    path.unlink(missing_ok=True)
    record, = execute_plan(plan, plots=False, wrap=functools.partial(StepTap, path=path))
    if record.status != "ok":
        raise KvbenchError(f"the real run in {out} {record.status}: {record.error}")
    steps = StepSample.load(path)
    if len(steps.shapes) != record.summary["num_steps"]:
        raise KvbenchError(f"{len(steps.shapes)} steps observed in {out}, "
                           f"{record.summary['num_steps']} logged")
    return record, steps


def sim_run(spec: Spec, workload: str, rate: float, out: Path, seed: int, profile: Path
            ) -> RunRecord:
    from kvbench.run.execute import execute_plan

    plan = _plan(_flags(spec, workload, rate, seed=seed, sim=profile), out)
    record, = execute_plan(plan, plots=False)
    if record.status != "ok":
        raise KvbenchError(f"the simulated run in {out} {record.status}: {record.error}")
    return record


def fit_profiles(steps: StepSample, base: Profile
                 ) -> tuple[str, dict[str, Profile], dict[str, Any]]:
    """Per structure of the step cost, a profile fitted on the calibration run's steps with a
    fixed quarter held out, and its errors on the held-out steps by kind. The structure kept
    is the one whose held-out median error, averaged over the kinds of step, is least:
    decodes outnumber the prefills that make TTFT a hundredfold, so each kind counts once."""
    from kvbench.engines.model.presets import get_preset

    preset, hardware = get_preset(base.model), base.hardware_spec()
    keep = [i for i, s in enumerate(steps.shapes) if s.num_tokens > 0]
    shapes = [steps.shapes[i] for i in keep]
    peak = CostModel(preset, hardware)
    x = np.array([features(peak, s) for s in shapes])
    cycles = steps.cycles
    t = np.array([cycles[i] for i in keep])
    held = holdout_mask(len(t), 4)
    held_shapes = [s for s, h in zip(shapes, held, strict=True) if h]
    profiles, by_kind, score = {}, {}, {}
    for name, (coef, err) in fit_forms(x, t, held).items():
        cost = CostModel(preset, dataclasses.replace(hardware, coef=coef))
        by_kind[name] = step_errors(held_shapes, t[held].tolist(),
                                    [cost.step_time_s(s) for s in held_shapes])
        medians = [k["median_ape_pct"] for k in by_kind[name].values() if k["n"]]
        score[name] = float(np.mean(medians))
        fit = FitSummary(
            train_points=int((~held).sum()), heldout_points=int(held.sum()),
            train_median_err_pct=float("nan"), heldout_median_err_pct=err,
            heldout_p90_err_pct=float("nan"), heldout_max_err_pct=float("nan"),
            median_wall_over_cpu=float("nan"), form=name,
        )
        hw = dataclasses.replace(hardware, coef=coef).to_json()
        profiles[name] = base.model_copy(update={"hardware": hw, "fit": fit})
    best = min(score, key=score.__getitem__)
    return best, profiles, {"score_pct": score, "heldout_steps": by_kind}


def _base_profile(spec: Spec, record: RunRecord, command: str) -> Profile:
    """The profile's facts other than the fit, with the peak figures the fit is relative to:
    measured on a CPU, the datasheet's for a GPU."""
    import datetime as dt

    import torch

    from kvbench.engines.model.presets import get_preset
    from kvbench.run.devices import parse_device
    from kvbench.tools.calibrate.measure import measure_cpu_peaks

    preset = get_preset(spec.model)
    cuda = spec.device.startswith("cuda")
    hardware = parse_device(spec.device).hardware if cuda else measure_cpu_peaks(preset.dtype)
    source = ("datasheet figures of " + hardware.name if cuda else
              "measured on this CPU: torch copy bandwidth and matmul FLOP/s")
    profile = Profile(
        created_utc=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), command=command,
        device=spec.device, device_kind="cuda" if cuda else "cpu", model=preset.name,
        dtype=preset.dtype, attention=f"as the {spec.engine} engine runs it",
        torch_threads=torch.get_num_threads(), machine=record.machine,
        hardware=hardware.to_json(), hardware_source=source,
        grid={"workload": spec.calibration, "engine": spec.engine}, points=[],
        fit=FitSummary(train_points=0, heldout_points=0, train_median_err_pct=0,
                       heldout_median_err_pct=0, heldout_p90_err_pct=0,
                       heldout_max_err_pct=0, median_wall_over_cpu=0),
    )
    return profile


def _rows(record: RunRecord) -> list[dict[str, Any]]:
    return [r.model_dump() for r in record.requests]


def measure(spec: Spec, out: Path, say: Say, command: str) -> dict[str, Any]:
    """The real half: the calibration runs, then per validation workload a capacity sweep
    and a run at each load, then each load once more. Writes ``real/plan.json`` (what the
    simulated half needs, and how the real runs were measured) and returns it."""
    import json

    from kvbench.fileio import write_text_atomic
    from kvbench.results.provenance import Measurement

    measurement = Measurement(command)

    real = out / "real"
    say(f"{spec.engine}: calibration runs of {spec.calibration}")
    record, _ = real_run(spec, spec.calibration, math.inf, real / CALIBRATION[0], spec.seed + 1)
    paced = record.summary["request_throughput"]
    real_run(spec, spec.calibration, paced, real / CALIBRATION[1], spec.seed + 1)
    save_profile(_base_profile(spec, record, command), real / "peaks.json")
    plan: dict[str, Any] = {"spec": spec.to_json(), "command": command, "workloads": [],
                            "calibration_rate": paced}
    for workload in spec.validation:
        name = slug(workload)
        say(f"{spec.engine}: capacity sweep of {workload}")
        record, _ = real_run(spec, workload, math.inf, real / f"{name}-sweep-inf", spec.seed)
        sweep = [{"rate": "inf", "throughput": record.summary["request_throughput"]}]
        for k in spec.sweep:
            rate = k * sweep[0]["throughput"]
            record, _ = real_run(spec, workload, rate, real / f"{name}-sweep-{k:g}x", spec.seed)
            sweep.append({"rate": rate, "throughput": record.summary["request_throughput"]})
        capacity = max(p["throughput"] for p in sweep)
        levels = []
        for load in spec.loads:
            run = f"{name}-load{round(load * 100)}"
            say(f"{spec.engine}: {workload} at {load:.0%} of {capacity:.2f} req/s")
            real_run(spec, workload, load * capacity, real / run, spec.seed)
            levels.append({"load": load, "rate": load * capacity, "run": run})
        plan["workloads"].append({"workload": workload, "name": name, "sweep": sweep,
                                  "capacity_req_s": capacity, "levels": levels})
    # The repeats run after every first run, not beside it, so that a slow spell of the
    # machine shows as a difference between the two instead of hiding in both.
    for wl in plan["workloads"] if spec.repeat_real else ():
        for level in wl["levels"]:
            say(f"{spec.engine}: {wl['workload']} at {level['load']:.0%} again")
            real_run(spec, wl["workload"], level["rate"], real / f"{level['run']}-again",
                     spec.seed)
    plan["stamp"] = measurement.line(
        "The real runs are wall-clock figures of this machine and load; the simulated half "
        "is deterministic.")
    write_text_atomic(real / "plan.json", json.dumps(plan, indent=1) + "\n")
    return plan


def _compare_level(spec: Spec, out: Path, workload: str, level: dict[str, Any],
                   profiles: dict[str, Profile], best: str, say: Say) -> dict[str, Any]:
    """One load's real run against its simulation with each profile (and against its second
    real run): the errors, and the kept structure's per-request points for the figure."""
    from kvbench.engines.model.presets import get_preset
    from kvbench.results.schema import load_record

    real = out / "real"
    run = level["run"]
    real_record = load_record(real / run / f"{spec.engine}.json")
    real_rows = _rows(real_record)
    steps = StepSample.load(real / run / "steps.json")
    busy = [g / c for g, c in zip(steps.gaps, steps.cycles, strict=True) if g > 0]
    row: dict[str, Any] = {**level, "forms": {},
                           "gap_pct": 100 * float(np.median(busy)) if busy else 0.0}
    preset = get_preset(spec.model)
    again = real / f"{run}-again" / f"{spec.engine}.json"
    again_rows = _rows(load_record(again)) if again.is_file() else None
    for form, profile in profiles.items():
        say(f"simulating {run} ({form})")
        sim = sim_run(spec, workload, level["rate"], out / "sim" / slug(form) / run, spec.seed,
                      out / f"profile-{slug(form)}.json")
        cost = CostModel(preset, profile.hardware_spec())
        pairs = matched_requests(real_rows, _rows(sim))
        if form == best:
            row["points"] = {k: [[r[f"{k}_ms"], s[f"{k}_ms"]] for r, s in pairs
                                 if r[f"{k}_ms"] and s[f"{k}_ms"]]
                             for k in ("ttft", "tpot")}
        row["forms"][form] = {
            "requests": request_errors(pairs),
            # Against the repeat too: the gate judges the simulator by the real run it is
            # closer to, both being the machine's outcomes of the same load.
            **({"requests_again": request_errors(matched_requests(again_rows, _rows(sim)))}
               if again_rows is not None else {}),
            "run": run_errors(real_record.summary, sim.summary),
            "steps": step_errors(steps.shapes, steps.cycles,
                                 [cost.step_time_s(s) for s in steps.shapes]),
        }
    row["misses"] = misses(row["forms"][best]["requests"], level["load"])
    if again_rows is not None:
        row["noise"] = request_errors(matched_requests(real_rows, again_rows))
    return row


def resimulate(out: Path, say: Say) -> dict[str, Any]:
    """The simulated half, from the real half's files alone: fit every structure of the
    step cost on the calibration steps, simulate each validation run with each, and compare.
    Writes ``fidelity.json`` and returns it."""
    import json

    from kvbench.fileio import read_text, write_text_atomic

    real = out / "real"
    if not (real / "plan.json").is_file():
        raise KvbenchError(f"{out} holds no real runs of a fidelity check (real/plan.json); "
                           "run kvbench fidelity -o DIR first")
    plan = json.loads(read_text(real / "plan.json", "fidelity plan (.json)"))
    spec = Spec(**{**plan["spec"], "validation": tuple(plan["spec"]["validation"]),
                   "loads": tuple(plan["spec"]["loads"]), "sweep": tuple(plan["spec"]["sweep"])})
    peaks = load_profile(real / "peaks.json")
    steps = [StepSample.load(real / run / "steps.json") for run in CALIBRATION]
    best, profiles, fits = fit_profiles(StepSample.join(steps), peaks)
    result: dict[str, Any] = {"spec": spec.to_json(), "command": plan["command"],
                              "stamp": plan["stamp"],
                              "machine": peaks.machine, "form": best,
                              "calibration_fit": fits,
                              "coefficients": {k: p.hardware["coef"] for k, p in profiles.items()},
                              "workloads": []}
    for form, profile in profiles.items():
        save_profile(profile, out / f"profile-{slug(form)}.json")
    for wl in plan["workloads"]:
        rows = [_compare_level(spec, out, wl["workload"], level, profiles, best, say)
                for level in wl["levels"]]
        result["workloads"].append({**wl, "levels": rows})
    write_text_atomic(out / "fidelity.json", json.dumps(result, indent=1) + "\n")
    return result
