"""``kvbench fidelity``: how far the simulator's predictions are from real runs."""

# Typer options read best one per line, help text included (as in cli.py).

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from kvbench.cli.options import PLAN_PANEL, command_line, console, err_console
from kvbench.errors import KvbenchError


def fidelity(
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder for the real runs, the simulated runs and the table.")],
    engine: Annotated[str, typer.Option(help="The real engine: a built-in policy (paged, ...) or vllm (in-process).")] = "paged",
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N: where the real engine computes.")] = "cpu",
    model: Annotated[str, typer.Option(help="Model preset (random weights).")] = "tiny",
    calibration_workload: Annotated[str, typer.Option(help="Workload whose real run the cost model is fitted on (its seed is --seed + 1).")] = "mixed-text",
    workload: Annotated[list[str] | None, typer.Option(help="Validation workload: preset, FILE.jsonl or KIND:TRACE (repeatable; default mixed-text).")] = None,
    num_requests: Annotated[int, typer.Option(help="Requests per run.")] = 40,
    loads: Annotated[str, typer.Option(help="Load levels, fractions of the measured capacity, comma-separated.")] = "0.5,0.8,1.2",
    kv_memory: Annotated[str, typer.Option(help="KV budget of every run, real and simulated.")] = "4MiB",
    block_size: Annotated[int, typer.Option(help="Paged KV block size in tokens.")] = 16,
    max_model_len: Annotated[int, typer.Option(help="Context limit per sequence.")] = 2048,
    seed: Annotated[int, typer.Option(help="Seed of the validation workloads and their arrivals.")] = 0,
    cpu_threads: Annotated[int | None, typer.Option(help="torch's CPU threads for the real runs.")] = None,
    quick: Annotated[bool, typer.Option(help="A smoke check: 12 requests, loads 0.5 and 1.2, capacity from all-at-once alone.")] = False,
    resimulate: Annotated[bool, typer.Option("--resimulate", help="Only the simulated half, again, from the real runs already in --output.")] = False,
    max_median_error: Annotated[float | None, typer.Option(help="Exit 1 when a median per-request error (TTFT, TPOT or E2E, any load) is above this many percent and above the machine's own noise at that load.")] = None,
) -> None:
    """Measure the simulator's error against a real engine.

    Fits the cost model on one real run, then runs other workloads for real and in simulation
    with the fitted profile at loads relative to the real engine's capacity, and writes the
    per-request, per-percentile, run-level and per-step errors (fidelity.json, fidelity.md,
    fidelity.png)."""
    from kvbench.tools.fidelity import study
    from kvbench.tools.fidelity.report import write_report

    say = err_console.print
    if not resimulate:
        spec = _spec(engine, device, model, calibration_workload, workload, num_requests,
                     loads, kv_memory, block_size, max_model_len, seed, cpu_threads, quick)
        output.mkdir(parents=True, exist_ok=True)
        study.measure(spec, output, say, command_line())
    result = study.resimulate(output, say)
    table = write_report(result, output, result["stamp"])
    for wl in result["workloads"]:
        for lv in wl["levels"]:
            line = _medians(lv["forms"][result["form"]]["requests"])
            verdict = "goal met" if not lv["misses"] else "goal missed"
            noise = f"; a real run against its repeat: {_medians(lv['noise'])}" \
                if lv.get("noise") else ""
            console.print(f"{wl['name']} at {lv['load']:.0%} load: median |error| {line} "
                          f"({verdict}){noise}")
    console.print(f"structure kept: {result['form']}; table written to {table}")
    if max_median_error is not None:
        from kvbench.tools.fidelity.errors import gate_failures

        failures = gate_failures(result, max_median_error)
        for failure in failures:
            err_console.print(f"{failure} is above --max-median-error {max_median_error:g}%")
        if failures:
            raise typer.Exit(1)

def _medians(errors: dict) -> str:
    """``TTFT 8.2%, TPOT 11.9%, E2E 11.5%``: the median per-request errors of one load."""
    cells = []
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2el")):
        median = errors[key]["median_ape_pct"]
        cells.append(f"{name} " + ("–" if median is None else f"{median:.1f}%"))
    return ", ".join(cells)


def _spec(engine: str, device: str, model: str, calibration: str, workload: list[str] | None,
          num_requests: int, loads: str, kv_memory: str, block_size: int, max_model_len: int,
          seed: int, cpu_threads: int | None, quick: bool):
    """The check's settings, every flag checked before any run starts."""
    from kvbench.engines.model.presets import get_preset
    from kvbench.tools.fidelity.study import Spec

    if engine == "openai":
        raise KvbenchError("--engine openai: a served engine's steps are not observable; "
                           "check a built-in policy or vllm (in-process)")
    if device != "cpu" and not device.startswith("cuda"):
        raise KvbenchError(f"--device {device}: a fidelity check runs real compute: cpu or "
                           "cuda[:N] (the simulated device is fitted from it)")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise KvbenchError(f"--device {device}: no CUDA device here; check the CPU "
                               "engines with --device cpu, or run this where there is a GPU")
    get_preset(model)
    try:
        levels = tuple(float(x) for x in loads.split(",") if x.strip())
    except ValueError:
        raise KvbenchError(f"--loads takes fractions, comma-separated (got {loads!r})") from None
    if not levels or not all(math.isfinite(x) and x > 0 for x in levels):
        raise KvbenchError(f"--loads takes positive fractions, e.g. 0.5,0.8,1.2 (got {loads!r})")
    if num_requests < 2:
        raise KvbenchError("--num-requests must be at least 2")
    spec = Spec(engine=engine, device=device, model=model, calibration=calibration,
                validation=tuple(workload or ("mixed-text",)), num_requests=num_requests,
                loads=levels, kv_memory=kv_memory, block_size=block_size,
                max_model_len=max_model_len, seed=seed, cpu_threads=cpu_threads)
    if quick:
        from dataclasses import replace

        spec = replace(spec, num_requests=12, loads=(0.5, 1.2), sweep=())
    return spec


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel=PLAN_PANEL)(fidelity)
