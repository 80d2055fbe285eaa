"""Options and workloads shared by the vLLM tests: the tiny model at block size 32."""

from __future__ import annotations

from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings
from kvbench.engines.model.presets import get_preset
from kvbench.run.devices import parse_device
from kvbench.workloads.model import Request, Segment, Workload

BLOCK = 32
TINY = get_preset("tiny")
BLOCK_BYTES = BLOCK * TINY.kv_bytes_per_token


def tiny_opts(num_blocks: int, *, max_len: int = 512, seqs: int = 4, batched: int = 128,
              block_size: int = BLOCK, device: str = "cpu") -> EngineSettings:
    """The tiny model with a KV budget of ``num_blocks`` blocks of ``block_size`` tokens."""
    return EngineSettings(
        preset=TINY,
        device=parse_device(device),
        kv_bytes=num_blocks * block_size * TINY.kv_bytes_per_token,
        block_size=block_size,
        prefix_caching=True,
        scheduler=SchedulerConfig(max_len, seqs, batched, True),
    )


def request(rid: str, prompt: int, output: int, *, arrival: float = 0.0,
            prefix: tuple[str, int] | None = None, n: int = 1) -> Request:
    """A text request whose prompt may start with a shared ``prefix`` = (key, tokens)."""
    segments = [Segment("text", prefix[1], prefix[0])] if prefix else []
    segments.append(Segment("text", prompt, f"own/{rid}"))
    return Request(rid, arrival, tuple(segments), output, n=n)


def mixed_workload() -> Workload:
    """Ten requests over 0.3 s: two share a 96-token system prompt, two a 64-token one."""
    reqs = [
        request(f"r{i}", 24 + (67 * i) % 170, 6 + (5 * i) % 14, arrival=0.03 * i,
                prefix=(("sys/a", 96), ("sys/b", 64), None, None, None)[i % 5])
        for i in range(10)
    ]
    return Workload("vllm-mixed", reqs, seed=0, source="tests")
