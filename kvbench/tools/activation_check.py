"""Checks the activation model (:mod:`kvbench.engines.sim.activations`) against real tensor memory:
the built-in engine's torch executor runs steps of known batch shapes, and the bytes its
forward allocates beyond the weights and the KV pool are measured and set against the
model's prediction for the same shapes.

- On the CPU the measurement is the torch profiler's allocator events (every allocation and
  free the CPU allocator makes during the step, internal buffers included); the executor's
  reference kernels are the model's ``cpu-reference`` attention.
- On CUDA it is ``torch.cuda.max_memory_allocated`` over the step, after a warm-up step
  (cuBLAS workspaces are allocated once) and a peak reset, for the Triton kernels (where
  installed), the model's ``fused`` (the torch reference is only their oracle there).

Also checked: Hugging Face's eager attention (the model's ``eager``), run standalone on
prefill chunks of a few lengths, against the model's eager workspace.

``python -m kvbench.tools.activation_check [--device cpu|cuda] [--dtype float32|bfloat16]``
prints the table.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.engines.builtin.scheduler import Scheduler, SchedulerConfig
from kvbench.engines.builtin.torch_executor import TorchExecutor
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.model.presets import ModelPreset, get_preset
from kvbench.engines.sim.activations import (
    ActivationModel,
    AttentionImpl,
    ForwardShape,
    forward_shape,
)
from kvbench.results.provenance import Measurement
from kvbench.workloads.model import Request, Segment

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Scenario:
    """Requests of ``prompts`` tokens (``output`` each) scheduled with a token budget;
    steps ``skip`` .. ``skip + steps - 1`` are measured."""

    name: str
    prompts: tuple[int, ...]
    budget: int
    output: int = 4
    steps: int = 1
    skip: int = 0


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("prefill 1 x 512", (512,), 8192),
    Scenario("prefill 1 x 2048", (2048,), 8192),
    Scenario("prefill 512 + 4 x 256", (512, 256, 256, 256, 256), 8192),
    Scenario("prefill 16 x 128", (128,) * 16, 8192),
    Scenario("chunked 1024 by 256", (1024,), 256, steps=4),
    Scenario("decode 64 at 257", (256,) * 64, 32768, output=8, skip=1),
    Scenario("decode 200 at 65", (64,) * 200, 32768, output=8, skip=1),
    Scenario("mixed: 63 decodes + 1 x 1024", (256,) * 63 + (1024,), 16384 + 64, output=8,
             skip=1),
)


@dataclass(frozen=True, slots=True)
class Row:
    scenario: str
    step: int
    attention: str
    shape: ForwardShape
    measured_bytes: int
    predicted_bytes: int

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def _cpu_peak(fn: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator holds during ``fn`` beyond what it held before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def _cuda_peak(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _run(executor: TorchExecutor, sc: Scenario,
         measure: Callable[[Callable[[], object]], int]) -> Iterator[tuple[int, object, int]]:
    """Runs the scenario's steps; yields (index, scheduled batch, measured bytes) of those
    it measures."""
    p = executor.preset
    kv = PagedKVManager(8192, BLOCK_SIZE, p.kv_bytes_per_token, 4096,
                        enable_prefix_caching=False, dtype=p.dtype)
    executor.bind(kv)
    sched = Scheduler(SchedulerConfig(4096, 256, sc.budget, True), kv)
    for i, tokens in enumerate(sc.prompts):
        r = Request(f"r{i}", 0.0, (Segment("text", tokens, f"{sc.name}/{i}"),), sc.output)
        sched.add(r, r.prompt_token_ids(p.vocab_size))
    for step in range(sc.skip + sc.steps):
        batch, _, _ = sched.schedule()
        out: list[list[int]] = []
        if step >= sc.skip:
            nbytes = measure(lambda b=batch, o=out: o.append(executor.execute(b, kv)))
            yield step, batch, nbytes
        else:
            out.append(executor.execute(batch, kv))
        sched.update(batch, out[-1])


def check_executor(preset: ModelPreset, device: str, kernels: str, attention: AttentionImpl,
                   scenarios: tuple[Scenario, ...] = SCENARIOS) -> list[Row]:
    """Every scenario's measured steps on the torch executor with ``kernels``."""
    executor = TorchExecutor(preset, device, attention=kernels)
    cuda = device.startswith("cuda")

    def measure(fn: Callable[[], object]) -> int:
        if not cuda:
            return _cpu_peak(fn)
        fn()  # warm: kernels' one-time workspaces; the step's KV is rewritten identically
        return _cuda_peak(fn)

    model = ActivationModel(preset, 1, attention, BLOCK_SIZE)
    rows = []
    for sc in scenarios:
        for step, batch, measured in _run(executor, sc, measure):
            shape = forward_shape(batch.items)
            rows.append(Row(sc.name, step, attention, shape, measured, model.peak(shape).total))
    executor.close()
    return rows


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``eager_attention_forward`` (``modeling_llama``) for one sequence: q
    ``[1, Hq, Q, D]``, k/v ``[1, Hkv, K, D]``, an additive mask ``[1, 1, Q, K]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    scores = scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


EAGER_CHUNKS = (128, 512, 2048)


def check_eager(preset: ModelPreset, device: str) -> list[Row]:
    """Hugging Face's eager attention run standalone on one prefill chunk of each length,
    against the model's eager workspace of that chunk."""
    dtype = getattr(torch, preset.dtype)
    peak = _cuda_peak if device.startswith("cuda") else _cpu_peak
    model = ActivationModel(preset, 1, "eager", 1)
    hq, hk, d = preset.num_heads, preset.num_kv_heads, preset.head_dim
    rows = []
    for n in EAGER_CHUNKS:
        q = torch.randn(1, hq, n, d, dtype=dtype, device=device)
        k = torch.randn(1, hk, n, d, dtype=dtype, device=device)
        v = torch.randn(1, hk, n, d, dtype=dtype, device=device)
        mask = torch.full((n, n), -math.inf, dtype=dtype, device=device).triu(1)[None, None]
        with torch.inference_mode():
            eager_attention(q, k, v, mask)  # warm
            measured = peak(lambda q=q, k=k, v=v, m=mask: eager_attention(q, k, v, m))
        # K/V are given contiguous here: nothing to gather.
        predicted = model.chunk_workspace(n, n) - model.gathered_kv_bytes(n)
        rows.append(Row(f"chunk {n}", 0, "eager (standalone)", ForwardShape(n, 1, ((n, n),)),
                        measured, predicted))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| scenario | step | attention | tokens | chunks (new/keys) | decodes | measured MiB "
             "| model MiB | error |", "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        counts = Counter(r.shape.chunks)
        chunks = " ".join(f"{n} x {q}/{k}" if n > 1 else f"{q}/{k}"
                          for (q, k), n in counts.items()) or "-"
        lines.append(
            f"| {r.scenario} | {r.step} | {r.attention} | {r.shape.num_tokens} | {chunks} | "
            f"{r.shape.num_decodes} | {r.measured_bytes / 2**20:.2f} | "
            f"{r.predicted_bytes / 2**20:.2f} | {r.error_pct:+.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args(argv)
    measurement = Measurement(shlex.join(["python", "-m", "kvbench.tools.activation_check",
                                          *(argv if argv is not None else sys.argv[1:])]))
    torch.set_num_threads(1)
    preset = get_preset(args.model).with_dtype(args.dtype)
    rows = []
    if not args.device.startswith("cuda"):
        rows = check_executor(preset, args.device, "reference", "cpu-reference")
    else:
        from kvbench.kernels.backend import triton_installed

        if triton_installed():
            rows = check_executor(preset, args.device, "triton", "fused")
    rows += check_eager(preset, args.device)
    print(measurement.line("Allocated bytes depend on the versions, not on the load."))
    print()
    print(markdown(rows))
    worst = max(rows, key=lambda r: abs(r.error_pct))
    print(f"\n{len(rows)} steps; largest error {worst.error_pct:+.1f}% ({worst.scenario}, "
          f"{worst.attention})")


if __name__ == "__main__":
    main()
