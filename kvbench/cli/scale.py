"""Scale commands: ``calibrate`` (fit the cost model to a real device) and ``capacity``
(requests that fit per KV layout on a GPU deployment, and their latency)."""

# Typer options read best one per line, help text included (as in cli.py).

from __future__ import annotations

import csv
import io
import itertools
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbench.cli.options import PLAN_PANEL, command_line, console, err_console
from kvbench.errors import KvbenchError
from kvbench.report.tables import print_table
from kvbench.tools.capacity import CapacityRow, Deployment


def calibrate(
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N: the device to profile.")] = "cpu",
    model: Annotated[str, typer.Option(help="Model preset to run (random weights).")] = "tiny",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Profile file (default: calibration-<device>-<model>.json).")] = None,
    repeats: Annotated[int | None, typer.Option(help="Timed rounds over the grid (median per point).")] = None,
) -> None:
    """Fit the cost model to real steps on this machine's CPU or GPU.

    Times real steps over a batch x context x chunk grid, fits the cost model and writes a
    profile that `kvbench run --device sim:PROFILE.json` simulates."""
    from dataclasses import replace

    from kvbench.engines.model.presets import get_preset
    from kvbench.tools.calibrate.measure import CPU_GRID, CUDA_GRID
    from kvbench.tools.calibrate.measure import calibrate as run_calibration
    from kvbench.tools.calibrate.profile import save_profile

    if device != "cpu" and not device.startswith("cuda"):
        raise KvbenchError(f"--device {device}: calibrate profiles real compute: cpu or cuda[:N]")
    grid = CPU_GRID if device == "cpu" else CUDA_GRID
    if repeats is not None:
        if repeats < 1:
            raise KvbenchError("--repeats must be at least 1")
        grid = replace(grid, repeats=repeats)
    out = output or Path(f"calibration-{device.replace(':', '')}-{model}.json")
    command = command_line()
    with Progress(
        TextColumn("timing steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=True,
    ) as progress:
        task = progress.add_task("calibrate", total=None)
        profile = run_calibration(
            get_preset(model), device, grid, command=command,
            on_point=lambda done, total: progress.update(task, completed=done, total=total),
        )
    save_profile(profile, out)
    table = Table(title=f"{profile.model} on {profile.device}: held-out grid points")
    for col in ("batch", "context", "chunk", "measured ms", "predicted ms", "error"):
        table.add_column(col, justify="right")
    for p in profile.points:
        if p.held_out:
            table.add_row(str(p.batch), str(p.context), str(p.chunk), f"{p.measured_s * 1e3:.2f}",
                          f"{p.predicted_s * 1e3:.2f}", f"{p.error_pct:+.1f}%")
    print_table(console, table)
    fit, coef = profile.fit, profile.coefficients()
    console.print(
        f"|error| median: train {fit.train_median_err_pct:.1f}% ({fit.train_points} points), "
        f"held out {fit.heldout_median_err_pct:.1f}% ({fit.heldout_points} points; "
        f"p90 {fit.heldout_p90_err_pct:.1f}%, max {fit.heldout_max_err_pct:.1f}%); "
        f"wall / CPU time of the steps {fit.median_wall_over_cpu:.2f} "
        f"({profile.torch_threads} torch threads)"
    )
    forms = ", ".join(f"{k} {v:.1f}%" for k, v in fit.form_errors_pct.items())
    console.print(f"structure: {fit.form} (held-out median error by structure: {forms})")
    attention = (
        f"attention {coef.attention_flops_efficiency:.3f} / "
        f"{coef.attention_bandwidth_efficiency:.3f}, " if coef.split_attention else ""
    )
    console.print(
        f"coefficients: linear layers {coef.flops_efficiency:.3f} of peak FLOPs / "
        f"{coef.bandwidth_efficiency:.3f} of peak bandwidth, {attention}"
        f"overhead {coef.overhead_s * 1e3:.3f} ms/step + {coef.per_seq_s * 1e6:.1f} us/seq "
        f"({profile.hardware_source})"
    )
    console.print(f"profile written to {out}; simulate it with --device sim:{out}")


def capacity(
    model: Annotated[str, typer.Option(help="Model preset(s), or a Hugging Face config.json (or a folder holding one), comma-separated.")],
    gpu: Annotated[str, typer.Option(help="GPU from the hardware table (kvbench list).")],
    tp: Annotated[str, typer.Option(help="Tensor-parallel degree(s), comma-separated.")] = "1",
    num_gpus: Annotated[int | None, typer.Option(help="GPUs in all (default: one TP group); the rest of each TP group are data-parallel replicas.")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens each request holds at its longest (prompt + output).")] = None,
    workload: Annotated[str | None, typer.Option(help="Plan for a workload's length mix instead: preset or FILE.jsonl.")] = None,
    block_size: Annotated[str, typer.Option(help="Paged block sizes, comma-separated.")] = "16,32",
    max_model_len: Annotated[str | None, typer.Option(help="Context limit(s), comma-separated: what contiguous/max_model_len reserves (default: the model's context).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="Fraction of device memory for weights, activations and KV.")] = 0.9,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences the scheduler runs at once.")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget per step (activation reserve, prefill chunk).")] = 8192,
    plot: Annotated[Path | None, typer.Option(help="Draw concurrency vs sequence length per policy to this PNG.")] = None,
    csv_out: Annotated[Path | None, typer.Option("--csv", help="Write the rows as CSV here.")] = None,
    grid: Annotated[list[str] | None, typer.Option(help="FIELD=V1,V2,...: plan every point of these axes (repeatable): model, gpu, tp, num_gpus, replicas, policy (or engine), block_size, max_model_len, gpu_memory_utilization, kv_memory, max_num_seqs, max_num_batched_tokens, seq_len; one row per point and KV layout.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="With --grid: write the rows as JSON here.")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="With --grid: plan a grid of more than 10,000 points.")] = False,
    kv_offload: Annotated[str | None, typer.Option(help="Offload tiers below device memory per replica, e.g. cpu:256GiB,disk:2TiB: how many more requests' KV each keeps, and how fast one comes back.")] = None,
) -> None:
    """Plan a GPU deployment: the most requests that fit at once per KV layout.

    Per KV layout (contiguous reservation policies, paged block sizes): max concurrent
    requests, KV bytes per token, KV budget, and the cost model's latency at that load; with
    --kv-offload, per tier the requests' KV it keeps besides them."""
    from kvbench.engines.model.hf_config import model_preset
    from kvbench.engines.sim.hardware import get_gpu
    from kvbench.fileio import write_text_atomic
    from kvbench.tools.capacity import plan, policies, write_concurrency_plot

    if grid and kv_offload:
        raise KvbenchError("--kv-offload plans the tiers of one deployment: drop --grid")
    if grid:
        _capacity_grid(grid, model, gpu, tp, num_gpus, seq_len, workload, block_size,
                       max_model_len, gpu_memory_utilization, max_num_seqs,
                       max_num_batched_tokens, csv_out, json_out, yes)
        return
    if json_out is not None:
        raise KvbenchError("--json writes grid rows: give --grid too (or --csv)")
    offload = _offload(kv_offload)
    if (seq_len is None) == (workload is None):
        raise KvbenchError("give one of --seq-len or --workload")
    hw = get_gpu(gpu)
    presets = [model_preset(name) for name in _csv(model)]
    tps, sizes = _ints(tp, "--tp"), _ints(block_size, "--block-size")
    lens = _ints(max_model_len, "--max-model-len") if max_model_len else [None]
    if not 0 < gpu_memory_utilization <= 1:
        raise KvbenchError("--gpu-memory-utilization must be in (0, 1]")
    if plot is not None and len(presets) * len(tps) * len(lens) > 1:
        raise KvbenchError("--plot draws one deployment: give one model, TP and max_model_len")
    sections = policies(sizes)
    header = ["model", "gpu", "tp", "num_gpus", "replicas", "max_model_len", "demand", "policy",
              "held_tokens", "reserved_tokens", "max_concurrent_per_replica",
              "max_concurrent_total", "paged_over_this", "kv_bytes_per_token",
              "kv_bytes_per_token_per_rank", "kv_budget_bytes_per_replica",
              "kv_budget_bytes_per_rank", "running", "decode_step_ms", "prefill_ms",
              "request_kv_bytes_per_rank", "kv_waste", *_tier_header(offload)]
    rows: list[list[object]] = []
    notes: list[str] = []
    for preset, t, mml in itertools.product(presets, tps, lens):
        limit = mml or preset.max_position
        if limit > preset.max_position:
            raise KvbenchError(f"--max-model-len {limit} exceeds {preset.name}'s context of "
                               f"{preset.max_position}")
        dep = Deployment(preset, hw, limit, tp=t, num_gpus=num_gpus,
                         gpu_memory_utilization=gpu_memory_utilization,
                         max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        demands, label, dropped = _demands(seq_len, workload, limit)
        if dropped:
            notes.append(f"{preset.name}: {dropped} requests of {workload} exceed max_model_len "
                         f"{limit} and are left out")
        where = f"{preset.name} TP{t} max_model_len {limit}"
        if preset.mixed_kv():
            if plot is not None or offload is not None:
                raise KvbenchError(f"{preset.mixed_kv()}: --plot and --kv-offload plan one "
                                   "kind of KV; drop them to plan its layer groups")
            rows += _group_rows(dep, label, demands, sizes, notes, where)
            continue
        try:
            result = plan(dep, sections, demands)
        except KvbenchError as exc:
            notes.append(f"{where}: {exc}")
            continue
        rows += _policy_rows(dep, label, result, _tiers(dep, offload, demands, sizes), offload)
        if plot is not None:
            console.print(f"figure written to {write_concurrency_plot(dep, sections, plot, seq_len)}")
    if not rows:
        raise KvbenchError("no deployment could be planned:\n" + "\n".join(notes))
    for note in notes:
        err_console.print(note)
    if csv_out is not None:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["command", *header])
        command = command_line()
        writer.writerows([command, *row] for row in rows)
        write_text_atomic(csv_out, buf.getvalue())
        console.print(f"rows written to {csv_out}")


GRID_COLUMNS = ("policy", "max_concurrent_per_replica", "max_concurrent_total", "replicas",
                "reserved_tokens", "held_tokens", "kv_budget_bytes_per_rank", "running",
                "decode_step_ms", "prefill_ms")


def _capacity_grid(
    axes_text: list[str], model: str, gpu: str, tp: str, num_gpus: int | None,
    seq_len: int | None, workload: str | None, block_size: str, max_model_len: str | None,
    gpu_memory_utilization: float, max_num_seqs: int, max_num_batched_tokens: int,
    csv_out: Path | None, json_out: Path | None, yes: bool,
) -> None:
    """``kvbench capacity --grid``: one row per grid point and KV layout."""
    import json

    from kvbench.fileio import write_text_atomic
    from kvbench.tools.capacity import grid_deployment, parse_grid_axis, plan
    from kvbench.tools.grid import check_grid_size

    axes = [parse_grid_axis(text) for text in axes_text]
    if len({a.field for a in axes}) != len(axes):
        raise KvbenchError("--grid names the same field twice")
    check_grid_size(axes, yes)
    named = {a.field for a in axes}
    for field, text, flag in (("model", model, "--model"), ("tp", tp, "--tp"),
                              ("max_model_len", max_model_len, "--max-model-len")):
        if text is not None and "," in text and field not in named:
            raise KvbenchError(f"{flag} {text}: with --grid give several values as --grid "
                               f"{field}={text}")
    base: dict[str, object] = {
        "model": _csv(model)[0], "gpu": gpu, "tp": _ints(tp, "--tp")[0], "num_gpus": num_gpus,
        "replicas": None, "policy": None, "block_size": _ints(block_size, "--block-size"),
        "max_model_len": _ints(max_model_len, "--max-model-len")[0] if max_model_len else None,
        "gpu_memory_utilization": gpu_memory_utilization, "kv_memory": None,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "seq_len": seq_len,
    }
    for field in ("model", "gpu"):
        if field not in named:
            base[field] = parse_grid_axis(f"{field}={base[field]}").values[0]
    if "seq_len" not in named and (seq_len is None) == (workload is None):
        raise KvbenchError("give one of --seq-len, --workload or --grid seq_len=...")
    if "seq_len" in named and workload is not None:
        raise KvbenchError("--grid seq_len plans fixed lengths: leave out --workload")
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    for combo in itertools.product(*[list(zip(a.texts, a.values, strict=True)) for a in axes]):
        values = dict(base)
        point = {}
        for axis, (text, value) in zip(axes, combo, strict=True):
            values[axis.field] = value
            point[axis.field] = text
        label = ",".join(f"{k}={v}" for k, v in point.items())
        try:
            dep, sections = grid_deployment(values)
            demands, demand, dropped = _demands(values["seq_len"], workload, dep.max_model_len)  # type: ignore[arg-type]
            if dropped:
                notes.append(f"{label}: {dropped} requests of {workload} exceed max_model_len "
                             f"{dep.max_model_len} and are left out")
            result = plan(dep, sections, demands)
        except KvbenchError as exc:
            notes.append(f"{label}: {exc}")
            continue
        for r in result:
            rows.append({
                **point, "model": dep.preset.name, "gpu": dep.gpu.name, "tp": dep.tp,
                "num_gpus": dep.gpus, "max_model_len": dep.max_model_len, "demand": demand,
                "policy": r.policy, "max_concurrent_per_replica": r.max_concurrent,
                "max_concurrent_total": r.total_concurrent, "replicas": r.replicas,
                "reserved_tokens": round(r.reserved_tokens, 1),
                "held_tokens": round(r.held_tokens, 1),
                "kv_budget_bytes_per_rank": r.kv_budget_bytes_per_rank, "running": r.running,
                "decode_step_ms": round(r.decode_step_s * 1e3, 3),
                "prefill_ms": round(r.prefill_s * 1e3, 3),
            })
    keys = [a.field for a in axes if a.field not in GRID_COLUMNS]
    table = Table(title=f"capacity over {' x '.join(a.name for a in axes)}: "
                        f"{len(rows)} rows")
    for col in (*keys, *GRID_COLUMNS):
        table.add_column(col, justify="left" if col in (*keys, "policy") else "right")
    for row in rows:
        table.add_row(*(str(row[k]) for k in (*keys, *GRID_COLUMNS)))
    print_table(console, table)
    for note in notes:
        err_console.print(note)
    header = list(dict.fromkeys([*keys, "model", "gpu", "tp", "num_gpus", "max_model_len",
                                 "demand", *GRID_COLUMNS]))
    command = command_line()
    if csv_out is not None:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["command", *header])
        writer.writerows([command, *(row[k] for k in header)] for row in rows)
        write_text_atomic(csv_out, buf.getvalue())
        console.print(f"rows written to {csv_out}")
    if json_out is not None:
        body = {"command": command, "axes": {a.name: list(a.texts) for a in axes},
                "rows": [{k: row[k] for k in header} for row in rows], "notes": notes}
        write_text_atomic(json_out, json.dumps(body, indent=1) + "\n")
        console.print(f"rows written to {json_out}")
    if not rows:
        raise KvbenchError("no grid point could be planned (see the notes above)")


def _print_deployment(dep: Deployment, demand: str, result: list[CapacityRow]) -> None:
    from kvbench.units import format_bytes

    first = result[0]
    table = Table(
        title=f"{dep.preset.name} on {dep.label}, max_model_len {dep.max_model_len}, "
        f"requests of {demand}",
        caption=f"KV {format_bytes(first.kv_bytes_per_token_per_rank)}/token/rank, budget "
        f"{format_bytes(first.kv_budget_bytes_per_rank)}/rank after weights, activations and "
        f"non-torch memory (gpu_memory_utilization {dep.gpu_memory_utilization}); TPOT = one "
        f"decode step of the running requests (max_num_seqs {dep.max_num_seqs})",
    )
    for col in ("policy", "reserved tok/req", "held", "max concurrent/replica", "total",
                "paged ÷ this", "TPOT ms", "prefill ms"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    paged = _paged_concurrency(result)
    for r in result:
        table.add_row(
            r.policy, f"{r.reserved_tokens:.0f}", f"{100 * r.held_fraction:.0f}%",
            str(r.max_concurrent), str(r.total_concurrent),
            f"{paged / r.max_concurrent:.2f}" if r.max_concurrent else "-",
            f"{r.decode_step_s * 1e3:.1f}" + (f" @{r.running}" if r.running < r.max_concurrent else ""),
            f"{r.prefill_s * 1e3:.1f}",
        )
    print_table(console, table)


def _policy_rows(dep: Deployment, demand: str, result: list[CapacityRow], tiers,
                 offload) -> list[list[object]]:
    """Print one deployment's plan per KV layout; return its CSV rows."""
    _print_deployment(dep, demand, result)
    paged = _paged_concurrency(result)
    return [[
        dep.preset.name, dep.gpu.name, dep.tp, dep.gpus, dep.replicas, dep.max_model_len, demand,
        r.policy, round(r.held_tokens, 1), round(r.reserved_tokens, 1), r.max_concurrent,
        r.total_concurrent, round(paged / r.max_concurrent, 3) if r.max_concurrent else "",
        r.kv_bytes_per_token, r.kv_bytes_per_token_per_rank, r.kv_budget_bytes,
        r.kv_budget_bytes_per_rank, r.running, round(r.decode_step_s * 1e3, 3),
        round(r.prefill_s * 1e3, 3), round(r.reserved_tokens * r.kv_bytes_per_token_per_rank),
        round(1 - r.held_fraction, 4), *_tier_cells(tiers.get(r.policy), offload),
    ] for r in result]


def _group_rows(dep: Deployment, demand: str, demands, sizes: list[int], notes: list[str],
                where: str) -> list[list[object]]:
    """Plan a model with several kinds of KV per layer group: print its table, return its
    CSV rows (no latency columns: the cost model reads one context for every layer)."""
    from kvbench.tools.capacity import plan_groups
    from kvbench.units import format_bytes

    try:
        result, why_not = plan_groups(dep, sizes, demands)
    except KvbenchError as exc:
        notes.append(f"{where}: {exc}")
        return []
    notes.extend(f"{where}: {n}" for n in why_not)
    p, budget = dep.preset, result[0].kv_budget_bytes_per_rank
    table = Table(
        title=f"{p.name} on {dep.label}, max_model_len {dep.max_model_len}, requests of "
        f"{demand}: layer groups " + " + ".join(g.describe() for g in p.layer_groups),
        caption=f"KV budget {format_bytes(budget)}/rank; bytes per request on one rank; "
        "waste: what no token or state fills (paging, padding)")
    for col in ("policy", "KV/request", "needed", "waste", "padding layers",
                "max concurrent/replica", "total", "per-group ÷ this"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    best = next(r.max_concurrent for r in result if r.policy.startswith("per-group"))
    rows: list[list[object]] = []
    for r in result:
        ratio = round(best / r.max_concurrent, 3) if r.max_concurrent else ""
        table.add_row(r.policy, format_bytes(r.request_bytes), format_bytes(r.needed_bytes),
                      f"{100 * r.waste_fraction:.1f}%", str(r.padding_layers),
                      str(r.max_concurrent), str(r.total_concurrent), str(ratio or "-"))
        rows.append([
            p.name, dep.gpu.name, dep.tp, dep.gpus, dep.replicas, dep.max_model_len, demand,
            r.policy, "", "", r.max_concurrent, r.total_concurrent, ratio,
            p.kv_bytes_per_token_per_rank(dep.tp) * dep.tp, p.kv_bytes_per_token_per_rank(dep.tp),
            budget * dep.tp, budget, min(r.max_concurrent, dep.max_num_seqs), "", "",
            round(r.request_bytes), round(r.waste_fraction, 4),
        ])
    print_table(console, table)
    return rows


def _offload(text: str | None):
    from kvbench.engines.kv.offload import OffloadSpec

    return None if text is None else OffloadSpec.model_validate(text)


def _tier_header(offload) -> list[str]:
    if offload is None:
        return []
    return ["recompute_ms", *(f"{t.kind}_{cell}" for t in offload.tiers
                              for cell in ("sessions", "sessions_per_gib", "load_ms"))]


def _tier_cells(rows, offload) -> list[object]:
    """A paged row's tier columns (empty for contiguous rows, which keep nothing below)."""
    if offload is None:
        return []
    if rows is None:
        return [""] * len(_tier_header(offload))
    return [round(rows[0].recompute_s * 1e3, 3), *(
        v for t in rows for v in (t.sessions, round(t.sessions_per_gib, 3),
                                  round(t.load_s * 1e3, 3)))]


def _tiers(dep, offload, demands, block_sizes: list[int]) -> dict[str, list]:
    """Per paged policy label, its tier rows (printed)."""
    if offload is None:
        return {}
    from kvbench.engines.kv.paged import PagedPolicy
    from kvbench.tools.capacity import plan_tiers
    from kvbench.units import format_bytes

    out = {PagedPolicy(block_size=bs).label(): plan_tiers(dep, offload, demands, bs)
           for bs in block_sizes}
    table = Table(title=f"Offload tiers under each replica of {dep.preset.name} on {dep.label}",
                  caption="sessions: requests whose whole KV the tier keeps besides those "
                  "running; load: one back over the link; recompute: prefilling it again")
    for col in ("policy", "tier", "size", "link", "sessions", "per GiB", "load ms",
                "recompute ms", "load ÷ recompute"):
        table.add_column(col, justify="left" if col in ("policy", "tier", "link") else "right")
    for policy, rows in out.items():
        for t in rows:
            table.add_row(policy, t.kind, format_bytes(t.capacity_bytes), t.link,
                          str(t.sessions), f"{t.sessions_per_gib:.2f}", f"{t.load_s * 1e3:.1f}",
                          f"{t.recompute_s * 1e3:.1f}", f"{t.load_s / t.recompute_s:.2f}")
    print_table(console, table)
    return out


def _paged_concurrency(result: list[CapacityRow]) -> int:
    """The first paged policy's concurrency: what each row is compared with."""
    return next(r.max_concurrent for r in result if r.policy.startswith("paged"))


def _demands(seq_len: int | None, workload: str | None, limit: int):
    from kvbench.tools.capacity import Demand

    if seq_len is not None:
        if seq_len < 1:
            raise KvbenchError("--seq-len must be at least 1")
        return [Demand(seq_len)], f"{seq_len} tokens", 0
    from kvbench.workloads.io import load_workload_arg

    assert workload is not None
    wl = load_workload_arg(workload)
    all_demands = [Demand(r.prompt_tokens, r.output_tokens, r.n) for r in wl.requests]
    kept = [d for d in all_demands if d.tokens <= limit]
    return kept, wl.name, len(all_demands) - len(kept)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in _csv(text)]
    except ValueError:
        raise KvbenchError(f"{flag} takes whole numbers, comma-separated (got {text!r})") from None
    if not values or min(values) < 1:
        raise KvbenchError(f"{flag} takes positive whole numbers (got {text!r})")
    return values


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel=PLAN_PANEL)(calibrate)
    app.command(rich_help_panel=PLAN_PANEL)(capacity)
