"""Bad input to run-shaped commands: exit 2, no traceback, a message that says what to do —
and nothing written before every check has passed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, run_cli
from kvbench.engines.model.presets import get_preset
from kvbench.errors import KvbenchError
from kvbench.run.overrides import RunFlags, resolve_suite
from kvbench.run.plan import plan_run

SIM = ["--device", "sim:a100-80gb", "--model", "llama-3-8b", "--num-requests", "4"]


def _fails(capsys, args: list[str], *words: str) -> str:
    code, out = run_cli(args, capsys)
    assert code == 2, out
    assert "Traceback" not in out
    for word in words:
        assert word in out, (word, out)
    return out


# --- option values (issue 11, item 7) -------------------------------------------------------

@pytest.mark.parametrize(("args", "words"), [
    (["--block-size", "0"], ["--block-size", "greater than or equal to 1"]),
    (["--block-size", "-1"], ["--block-size"]),
    (["--num-requests", "0"], ["--num-requests"]),
    (["--num-requests", "-5"], ["--num-requests"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["--max-num-batched-tokens", "0"], ["--max-num-batched-tokens"]),
    (["--cpu-threads", "0"], ["--cpu-threads"]),
    (["--max-concurrency", "0"], ["--max-concurrency"]),
    (["--attention", "bogus"], ["--attention", "reference", "triton"]),
    (["--clock", "sundial"], ["--clock", "wall", "virtual"]),
    (["--slo", "ttft:nan"], ["SLO ttft", "positive number"]),
    (["--slo", "ttft:inf"], ["SLO ttft"]),
    (["--slo", "ttft:100,ttft:200"], ["given twice"]),
    (["--seed", "-1"], ["--seed", "greater than or equal to 0"]),
    (["--engines", "pagd"], ["unknown engine 'pagd'", "paged"]),
    (["--engines", ","], ["no engines selected"]),
    (["--device", "sim:a100-80gbx3"], ["tensor parallelism 3", "1, 2, 4, 8"]),
    (["--device", "tpu"], ["unknown device", "sim:GPU"]),
    (["--kv-memory", "1TiB"], ["exceeds sim:a100-80gb's memory", "smaller budget"]),
    (["--kv-memory", "lots"], ["lots"]),
])
def test_bad_option_values_say_what_to_do(capsys, tmp_path, args, words) -> None:
    _fails(capsys, ["run", *SIM, "--out", str(tmp_path / "out"), *args], *words)
    assert not (tmp_path / "out").exists()


def test_every_run_shaped_command_takes_the_same_flags(capsys, tmp_path) -> None:
    for command in ("soak", "sweep"):
        _fails(capsys, [command, *SIM, "--attention", "bogus", "--out", str(tmp_path / command)],
               "--attention")
        _fails(capsys, [command, *SIM, "--cpu-threads", "0", "--out", str(tmp_path / command)],
               "--cpu-threads")


# --- suite files (items 8 and 11) -----------------------------------------------------------

@pytest.mark.parametrize(("content", "words"), [
    (b"", ["empty", "[run] engines"]),
    (b"# only a comment\n", ["empty"]),
    (b"\xff\xfe[run]\n", ["UTF-16", "save it as UTF-8"]),
    (b"[run]\xe9\n", ["not UTF-8"]),
    (b"[run]\x00engines = []", ["NUL byte"]),
    (b"[run]\nblock_size = 0\n", ["suite.toml", "run.block_size"]),
    (b"[run]\nengines = ['paged']\nturbo = true\n", ["suite.toml", "turbo"]),
    (b"[engines.x]\nkind = 'paged'\nreservation = 'request'\n", ["suite.toml", "reservation"]),
    (b"[engines.x]\nkind = 'warp'\n", ["suite.toml", "warp"]),
    (b"[run\n", ["suite.toml", "invalid TOML"]),
])
def test_bad_suite_files_name_the_file(capsys, tmp_path, content, words) -> None:
    path = tmp_path / "suite.toml"
    path.write_bytes(content)
    _fails(capsys, ["run", str(path), "--out", str(tmp_path / "out")], *words)


def test_a_suite_file_with_a_bom_loads(tmp_path) -> None:
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[run]\nengines = ['paged']\n")
    suite, _ = resolve_suite(str(path), RunFlags())
    assert suite.run.engines == ["paged"]


def test_a_folder_or_missing_file_as_suite(capsys, tmp_path) -> None:
    _fails(capsys, ["run", str(tmp_path)], "is a folder")
    _fails(capsys, ["run", str(tmp_path / "nope.toml")], "no such file", "suite")


def test_an_inline_generator_spec_runs(tmp_path) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(
        "[workload]\nnum_requests = 5\n[workload.spec]\nnum_requests = 10\n"
        "[[workload.spec.classes]]\nname = 'chat'\nprompt = {kind = 'fixed', value = 40}\n"
        "output = {kind = 'fixed', value = 4}\n"
        "[run]\ndevice = 'sim:a100-80gb'\nengines = ['paged']\n"
        "[model]\npreset = 'llama-3-8b'\n"
    )
    suite, base = resolve_suite(str(path), RunFlags())
    plan = plan_run(suite, base, tmp_path / "out", "test")
    assert len(plan.workload) == 5
    assert {r.prompt_tokens for r in plan.workload.requests} == {40}


def test_a_bad_inline_spec_names_the_key(capsys, tmp_path) -> None:
    path = tmp_path / "spec.toml"
    path.write_text("[workload.spec]\n[[workload.spec.classes]]\nprompt = {kind = 'nope'}\n")
    _fails(capsys, ["run", str(path), "--out", str(tmp_path / "out")], "workload.spec")


# --- the output folder (item 9) -------------------------------------------------------------

def test_out_that_is_a_file_or_lies_under_one(capsys, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _fails(capsys, ["run", *SIM, "--out", str(blocker)], "is a file")
    _fails(capsys, ["run", *SIM, "--out", str(blocker / "sub")], "lies under", "is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_out_that_cannot_be_written(capsys, tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _fails(capsys, ["run", *SIM, "--out", str(locked / "out")], "cannot write")


def test_out_holding_records_needs_force(capsys, tmp_path) -> None:
    out = tmp_path / "out"
    code, text = run_cli(["run", *SIM, "--engines", "paged", "--out", str(out)], capsys)
    assert code == 0, text
    _fails(capsys, ["run", *SIM, "--engines", "contiguous", "--out", str(out)],
           "already holds run records", "paged.json", "--force")
    code, text = run_cli(
        ["run", *SIM, "--engines", "contiguous", "--out", str(out), "--force"], capsys
    )
    assert code == 0, text
    assert sorted(p.name for p in out.glob("*.json")) == ["contiguous.json"]


# --- impossible physics (item 10) -----------------------------------------------------------

def test_tensor_parallel_degrees_follow_the_heads() -> None:
    llama2, qwen = get_preset("llama-2-7b"), get_preset("qwen2.5-7b")
    llama2.check_tensor_parallel(8)
    qwen.check_tensor_parallel(4)  # 28 heads, 4 KV heads
    qwen.check_tensor_parallel(28)  # KV heads replicated 7 times
    for preset, tp in ((llama2, 3), (qwen, 8), (qwen, 3)):
        with pytest.raises(KvbenchError, match=f"tensor parallelism {tp} cannot split"):
            preset.check_tensor_parallel(tp)


def test_kv_memory_above_a_real_device_warns(tmp_path) -> None:
    suite, base = resolve_suite("quick-cpu", RunFlags(kv_memory="100TiB", num_requests=1))
    with pytest.raises(KvbenchError):  # 100 TiB of tiny-model KV cannot be allocated either
        plan = plan_run(suite, base, tmp_path / "out", "test")
        assert any("exceeds" in w and "will not fit" in w for w in plan.warnings)
        raise KvbenchError("planned")


@pytest.mark.parametrize("field", ["hbm_bytes_per_s", "flops_per_s"])
@pytest.mark.parametrize("value", [0.0, float("nan"), float("inf"), -1.0])
def test_calibration_profiles_with_impossible_figures_are_refused(
    capsys, tmp_path, field, value
) -> None:
    path = _write_profile(tmp_path / "p.json", **{field: value})
    _fails(capsys, ["run", *SIM[2:], "--device", f"sim:{path}", "--out", str(tmp_path / "o")],
           "p.json", field)


def _write_profile(path, **hardware):
    """A profile file as `kvbench calibrate` writes it, with ``hardware`` figures replaced."""
    from kvbench.engines.sim.hardware import CPU_HARDWARE
    from kvbench.tools.calibrate.profile import FitSummary, Profile, save_profile

    fit = FitSummary(train_points=6, heldout_points=2, train_median_err_pct=5.0,
                     heldout_median_err_pct=6.0, heldout_p90_err_pct=9.0,
                     heldout_max_err_pct=12.0, median_wall_over_cpu=1.0)
    profile = Profile(
        created_utc="2026-01-01T00:00:00+00:00", command="kvbench calibrate", device="cpu",
        device_kind="cpu", model="llama-3-8b", dtype="bfloat16", attention="reference",
        torch_threads=1, machine={}, hardware=CPU_HARDWARE.to_json() | hardware,
        hardware_source="test", grid={}, points=[], fit=fit,
    )
    return save_profile(profile, path)


def test_a_profile_that_is_not_text_is_refused(capsys, tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"\x89PNG\r\n\x00")
    _fails(capsys, ["run", *SIM[2:], "--device", f"sim:{path}"], "p.json", "not UTF-8")


# --- interrupts lose nothing (item 12) ------------------------------------------------------

def _start_run(tmp_path, out) -> subprocess.Popen:
    # Enough requests that each engine's replay takes seconds, so that the signal lands in
    # a run (the first's, or the second's on a fast machine).
    args = [sys.executable, "-m", "kvbench.cli", "run", "--device", "sim:a100-80gb",
            "--model", "llama-3-8b", "--workload", "mixed-text", "--num-requests", "50000",
            "--engines", "paged,contiguous", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A job started in the background by a non-interactive shell inherits SIGINT ignored
    # (and Python then keeps it ignored): the run gets SIGINT's default, as from a terminal.
    return subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_writes_every_record_and_the_summary(tmp_path, sig, status) -> None:
    out = tmp_path / "out"
    proc = _start_run(tmp_path, out)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(1.5)  # into the first engine's start or run
        proc.send_signal(sig)
        text, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == status, text
    assert "Traceback" not in text
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(records) == {"paged", "contiguous"}, text
    word = "SIGTERM" if sig == signal.SIGTERM else "Ctrl-C"
    # The signal stopped one engine (paged's, or contiguous's once paged's run had ended):
    # those before it ran to the end, those after it never started.
    statuses = [records[name]["status"] for name in ("paged", "contiguous")]
    assert "interrupted" in statuses, text
    first = statuses.index("interrupted")
    assert statuses[:first] == ["ok"] * first
    assert word in records[("paged", "contiguous")[first]]["error"]
    for name in ("paged", "contiguous")[first + 1 :]:
        assert records[name]["status"] == "interrupted"
        assert "not started" in records[name]["error"]
        assert word in records[name]["error"]
    assert (out / "summary.md").is_file()


@pytest.mark.parametrize("where", ["record", "setup"])
def test_a_signal_between_runs_waits_for_the_records(tmp_path, monkeypatch, where) -> None:
    """A real SIGINT while the first engine's record is built, or while its run is set up
    (before its loop): held back until the record is written whole (then raised, once the
    summary is written too) or the loop starts (which records the interrupt), so nothing is
    lost; the next engine does not start."""
    from kvbench.run import execute, harness

    module, attr = (execute, "record_of") if where == "record" else (harness, "wave_requests")
    real, calls = getattr(module, attr), []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, signalled)
    suite, base = resolve_suite("quick-sim", RunFlags(num_requests=3))
    plan = plan_run(suite, base, tmp_path / "out", "test")
    if where == "record":
        with pytest.raises(KeyboardInterrupt):
            execute.execute_plan(plan)
    else:
        execute.execute_plan(plan)
    out = tmp_path / "out"
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    if where == "record":
        assert records["paged"]["status"] == "ok"
        assert records["paged"]["summary"]["completed"] == 3
        assert len(calls) == 2  # paged's record built once, not restarted; contiguous's
    else:
        assert records["paged"]["status"] == "interrupted"
        assert "Ctrl-C" in records["paged"]["error"]
    assert records["contiguous"]["status"] == "interrupted"
    assert "not started" in records["contiguous"]["error"]
    assert (out / "summary.md").is_file()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupt_while_an_engine_starts_is_recorded(tmp_path, monkeypatch) -> None:
    from kvbench.run import execute

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(execute, "build_engine", interrupted)
    suite, base = resolve_suite("quick-sim", RunFlags(num_requests=3))
    plan = plan_run(suite, base, tmp_path / "out", "test")
    records = execute.execute_plan(plan)
    assert [r.status for r in records] == ["interrupted", "interrupted"]
    assert "while the engine was starting" in records[0].error
    assert "not started" in records[1].error
    assert (tmp_path / "out" / "summary.md").is_file()
    assert REPO.is_dir()


def test_an_interrupt_while_a_record_is_built_still_writes_it(tmp_path, monkeypatch) -> None:
    """The first engine's run ended; Ctrl-C comes while its record is built: the record is
    written as the run went, the next engine does not start, and the interrupt goes on."""
    from kvbench.run import execute

    real, calls = execute.record_of, []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(execute, "record_of", interrupted_once)
    suite, base = resolve_suite("quick-sim", RunFlags(num_requests=3))
    plan = plan_run(suite, base, tmp_path / "out", "test")
    with pytest.raises(KeyboardInterrupt):
        execute.execute_plan(plan)
    out = tmp_path / "out"
    records = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert records["paged"]["status"] == "ok"
    assert records["paged"]["summary"]["completed"] == 3
    assert records["contiguous"]["status"] == "interrupted"
    assert "not started" in records["contiguous"]["error"]
    assert (out / "summary.md").is_file()


# --- vLLM's CPU block size chosen for the user (item 14) -----------------------------------

def test_vllms_cpu_block_multiple_is_chosen_unless_the_user_chose() -> None:
    from kvbench.engines.external.vllm import VllmSection
    from kvbench.engines.kv.paged import PagedPolicy
    from kvbench.run.devices import parse_device
    from kvbench.run.plan import _block_size

    cpu, sim = parse_device("cpu"), parse_device("sim:h200")
    notes: list[str] = []
    sections = [PagedPolicy(), VllmSection()]
    assert _block_size(16, False, sections, cpu, notes) == 32
    assert len(notes) == 1 and "block size 32" in notes[0] and "vllm" in notes[0]
    assert _block_size(16, True, sections, cpu, notes) == 16  # vLLM's check then refuses it
    assert _block_size(16, False, sections, sim, []) == 16
    assert _block_size(16, False, [PagedPolicy()], cpu, []) == 16
    assert _block_size(64, False, sections, cpu, []) == 64


# --- names that become paths, and privacy (items 1 and 2) -----------------------------------

def test_a_suite_or_engine_name_cannot_steer_paths(capsys, tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text("name = '../../x'\n[run]\ndevice = 'sim:a100-80gb'\nengines = ['paged']\n")
    _fails(capsys, ["run", str(path)], "suite '../../x'", "letters, digits")
    path.write_text("[engines.'../e']\nkind = 'paged'\n[run]\ndevice = 'sim:a100-80gb'\n"
                    "engines = ['../e']\n")
    _fails(capsys, ["run", str(path), "--out", str(tmp_path / "o")], "engine '../e'")
    assert not (tmp_path / "o").exists()


def test_records_show_the_home_folder_as_a_tilde(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "out"
    code, text = run_cli(["run", *SIM, "--engines", "paged", "--out", str(out)], capsys)
    assert code == 0, text
    command = json.loads((out / "paged.json").read_text())["command"]
    assert "--out ~/out" in command and str(tmp_path) not in command
