"""The ``kvbench`` command line."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbench.cli import regress, scale, telemetry, workload
from kvbench.errors import KvbenchError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Benchmark KV-cache memory management: paged vs contiguous vs vLLM.",
)
regress.register(app)
scale.register(app)
telemetry.register(app)
workload.register(app)
console = Console()
err_console = Console(stderr=True)



@app.command()
def run(
    suite: Annotated[str | None, typer.Argument(help="Suite TOML file or name (default: the embedded default).")] = None,
    engines: Annotated[str | None, typer.Option(help="Comma-separated engines, e.g. paged,contiguous.")] = None,
    workload: Annotated[str | None, typer.Option(help="Workload preset, FILE.jsonl or KIND:TRACE_PATH (azure|mooncake|sharegpt).")] = None,
    num_requests: Annotated[int | None, typer.Option(help="Number of requests (first N of a file or trace).")] = None,
    seed: Annotated[int | None, typer.Option(help="Workload seed.")] = None,
    model: Annotated[str | None, typer.Option(help="Model preset.")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda[:N] | sim:GPU[xTP].")] = None,
    clock: Annotated[str | None, typer.Option(help="wall | virtual (default: virtual for sim, else wall).")] = None,
    kv_memory: Annotated[str | None, typer.Option(help="KV budget, e.g. 64MiB (default: from device memory).")] = None,
    block_size: Annotated[int | None, typer.Option(help="Paged KV block size in tokens.")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most sequences running at once.")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Token budget per step.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context limit per sequence.")] = None,
    chunked_prefill: Annotated[bool | None, typer.Option("--chunked-prefill/--no-chunked-prefill")] = None,
    prefix_caching: Annotated[bool | None, typer.Option("--prefix-caching/--no-prefix-caching")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: runs/<suite>-<time>).")] = None,
    repeat: Annotated[int, typer.Option(help="Run every engine N times; records hold medians and each repeat's values.")] = 1,
    shard: Annotated[str | None, typer.Option(help="Run only share I/N of the suite's engines (for CI matrices).")] = None,
    slo: Annotated[str | None, typer.Option(help="Goodput SLO in ms, e.g. ttft:500,tpot:50[,e2el:MS].")] = None,
    cpu_threads: Annotated[int | None, typer.Option(help="Intra-op threads of real compute on a CPU (default: torch's).")] = None,
    attention: Annotated[str | None, typer.Option(help="Attention kernels of real compute: auto (triton on CUDA when installed, else reference) | triton | reference.")] = None,
) -> None:
    """Run a suite: every engine on the same workload; print and write a comparison."""
    from kvbench.report.tables import table_rows
    from kvbench.run.execute import execute_plan
    from kvbench.run.overrides import RunFlags, resolve_suite
    from kvbench.run.plan import plan_run
    from kvbench.run.sharding import Shard

    the_suite, base = resolve_suite(suite, RunFlags(
        engines, workload, num_requests, seed, model, device, clock, kv_memory, block_size,
        max_num_seqs, max_num_batched_tokens, max_model_len, chunked_prefill, prefix_caching,
        slo, cpu_threads, attention,
    ))
    command = "kvbench " + shlex.join(sys.argv[1:])
    the_shard = Shard.parse(shard) if shard is not None else None
    plan = plan_run(the_suite, base, out, command, repeats=repeat, shard=the_shard)
    if not plan.engines:
        console.print(f"shard {the_shard} of {the_suite.name} has no engines to run")
        return
    for warning in plan.warnings:
        err_console.print(f"[yellow]warning:[/] {warning}")
    n_warnings = len(plan.warnings)
    console.print(
        f"[bold]{the_suite.name}[/]: {len(plan.workload)} requests ({plan.workload.name}, "
        f"digest {plan.workload.digest}), model {plan.preset.name}, device {plan.device.label}, "
        f"clock {plan.clock}, engines {', '.join(n for n, _ in plan.engines)}"
    )
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, transient=True,
    ) as progress:

        def on_engine(name: str):
            task = progress.add_task(name, total=len(plan.workload))
            return lambda done: progress.update(task, completed=done)

        records = execute_plan(plan, on_engine)
    table = Table(title=f"{the_suite.name} ({plan.device.label}, {plan.clock} clock)")
    table.add_column("metric")
    for rec in records:
        table.add_column(rec.engine, justify="right")
    for row in table_rows(records):
        table.add_row(*row)
    console.print(table)
    for rec in records:
        if rec.error:
            err_console.print(f"[red]{rec.engine} {rec.status}:[/] {rec.error.splitlines()[0]}")
    for warning in plan.warnings[n_warnings:]:
        err_console.print(f"[yellow]warning:[/] {warning}")
    console.print(f"records, summary.md and figures written to {plan.out_dir}")
    if any(rec.status == "interrupted" for rec in records):
        raise typer.Exit(130)
    if any(rec.status != "ok" for rec in records):
        raise typer.Exit(1)


@app.command("list")
def list_names() -> None:
    """Model presets, GPUs, engines, suites and workload presets."""
    from kvbench.engines.hardware import get_gpu, gpu_names
    from kvbench.engines.presets import get_preset, preset_names
    from kvbench.run.suite import BUILTIN_ENGINES, suite_names
    from kvbench.units import format_bytes
    from kvbench.workloads.presets import preset_names as workload_presets

    t = Table(title="model presets")
    for col in ("name", "params", "layers", "kv heads", "head dim", "dtype", "KV/token", "context"):
        t.add_column(col)
    for name in preset_names():
        p = get_preset(name)
        t.add_row(name, f"{p.num_params / 1e9:.2f}B", str(p.num_layers), str(p.num_kv_heads),
                  str(p.head_dim), p.dtype, format_bytes(p.kv_bytes_per_token), str(p.max_position))
    console.print(t)
    t = Table(title="GPUs (sim:NAME[xTP])")
    for col in ("name", "memory", "HBM GB/s", "dense TFLOPS", "link"):
        t.add_column(col)
    for name in gpu_names():
        g = get_gpu(name)
        t.add_row(name, format_bytes(g.memory_bytes), f"{g.hbm_bytes_per_s / 1e9:.0f}",
                  f"{g.flops_per_s / 1e12:.0f}", f"{g.link} {g.link_bytes_per_s / 1e9:.0f} GB/s")
    console.print(t)
    console.print("engines: " + ", ".join(BUILTIN_ENGINES))
    console.print("suites: " + ", ".join(suite_names()))
    console.print("workload presets: " + ", ".join(workload_presets()))


def main() -> None:
    try:
        app()
    except KvbenchError as exc:
        err_console.print(f"[red]error:[/] {exc}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
