"""The activation model against real tensor memory (CPU always, CUDA when present), and the
properties the device memory model relies on."""

from __future__ import annotations

import pytest
import torch

from kvbench.engines.model.presets import get_preset
from kvbench.engines.sim.activations import ActivationModel, ForwardShape
from kvbench.tools.activation_check import SCENARIOS, check_eager, check_executor

TINY = get_preset("tiny")
QWEN = get_preset("qwen2.5-7b")
# A prefill, chunks of several lengths, a chunk on top of earlier ones, decodes, a mix.
CPU_SCENARIOS = tuple(SCENARIOS[i] for i in (0, 2, 4, 5, 7))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_matches_the_cpu_executors_allocations(dtype: str) -> None:
    rows = check_executor(TINY.with_dtype(dtype), "cpu", "reference", "cpu-reference",
                          CPU_SCENARIOS)
    assert len(rows) == 8
    bad = [(r.scenario, r.step, round(r.error_pct, 1)) for r in rows if abs(r.error_pct) > 10]
    assert not bad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eager_workspace_matches_hugging_face_eager_attention(dtype: str) -> None:
    rows = check_eager(TINY.with_dtype(dtype), "cpu")
    # Within 10%: the standalone run also allocates the attention output, which the model
    # counts with q, k and v rather than in the workspace.
    assert rows and all(abs(r.error_pct) < 10 for r in rows), [r.error_pct for r in rows]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_matches_cuda_max_memory_allocated() -> None:
    from kvbench.kernels.backend import triton_installed

    # On CUDA the torch reference is only the Triton kernels' oracle (explicit matmuls), which
    # no serving engine runs: the kernels checked there are the fused Triton ones and eager.
    preset = TINY.with_dtype("bfloat16")
    rows = check_executor(preset, "cuda", "triton", "fused") if triton_installed() else []
    rows += check_eager(preset, "cuda")
    bad = [(r.scenario, r.attention, round(r.error_pct, 1)) for r in rows
           if abs(r.error_pct) > 15]
    assert not bad


def test_chunked_prefill_lowers_the_peak() -> None:
    model = ActivationModel(QWEN, attention="sdpa-dense-mask")
    whole = model.peak(ForwardShape(8192, 1, ((8192, 8192),)))
    chunk = model.peak(ForwardShape(2048, 0, ((2048, 8192),)))
    assert chunk.total < whole.total / 3


def test_unfused_attention_is_quadratic_and_fused_is_not() -> None:
    def attention(impl: str, n: int) -> int:
        return ActivationModel(QWEN, attention=impl).peak(ForwardShape(n, 1, ((n, n),))).attention

    for impl in ("sdpa-dense-mask", "eager"):
        assert 3.5 < attention(impl, 4096) / attention(impl, 2048) < 4.1
    assert attention("fused", 4096) == 2 * attention("fused", 2048)
    assert attention("fused", 4096) < attention("sdpa-dense-mask", 4096) / 100


def test_tensor_parallelism_splits_the_mlp() -> None:
    shape = ForwardShape(8192, 256, ((32, 32),) * 256)
    one = ActivationModel(QWEN, 1).peak(shape)
    two = ActivationModel(QWEN, 2).peak(shape)
    assert one.phase == two.phase == "mlp"
    assert two.parts["mlp_intermediate"] * 2 == one.parts["mlp_intermediate"]
    assert two.parts["residual_and_normed"] == one.parts["residual_and_normed"]


def test_profile_batch_is_vllms_even_split() -> None:
    shape = ForwardShape.profile(8192 + 5, 256)
    assert shape.num_sampled == 256 and shape.num_tokens == 8197
    assert shape.chunks[0] == (32, 32) and shape.chunks[-1] == (37, 37)
    assert ForwardShape.profile(100, 256).chunks == ((1, 1),) * 100
