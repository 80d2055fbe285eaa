"""Micro-benchmarks of the Triton decode attention on CUDA: paged (block-table lookups, blocks
scattered over the pool) versus contiguous (one extent per sequence), same kernel otherwise.

Each case reports, in ``extra_info``: the kernel time measured with CUDA events over
back-to-back calls with the L2 cache flushed in between (``device_us``), the KV bytes one
call must read (every sequence's K and V, once), the bytes/s that makes, and its percentage
of the device's peak HBM bandwidth from ``kvbench.engines.sim.hardware``. pytest-benchmark's
own timing is the wall time of one call including launch and a synchronise, as an engine step
sees it.
``benchmarks/gpu/summarize.py`` turns the JSON report into a paged-vs-contiguous table.

Run with ``pytest benchmarks/test_bench_attention_gpu.py --benchmark-json=FILE``; it skips
without CUDA or triton. Shapes are one Llama-3-8B layer (32 query heads over 8 KV heads of
128, bfloat16), 16 sequences decoding at 1k, 4k and 16k tokens.
"""

from __future__ import annotations

from importlib.util import find_spec

import numpy as np
import pytest
import torch

from kvbench.engines.model.presets import get_preset

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(find_spec("triton") is None, reason="needs triton"),
]

MODEL = get_preset("llama-3-8b")
DTYPE = torch.bfloat16
BATCH = 16
CONTEXTS = (1024, 4096, 16384)
LAYOUTS = ("contiguous", "paged-16", "paged-32", "paged-128")


@pytest.fixture(scope="module")
def gpu():
    from kvbench.run.devices import parse_device

    return parse_device("cuda").hardware


def _inputs(layout: str, context: int):
    from kvbench.kernels import triton_attention

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    hkv, d = MODEL.num_kv_heads, MODEL.head_dim
    num_slots = BATCH * context
    k_cache = torch.randn(num_slots, hkv, d, generator=gen, device=device, dtype=DTYPE)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen, device=device, dtype=DTYPE)
    query = torch.randn(BATCH, MODEL.num_heads, d, generator=gen, device=device, dtype=DTYPE)
    cu = torch.arange(BATCH + 1, dtype=torch.int32, device=device)
    lens = torch.full((BATCH,), context, dtype=torch.int32, device=device)
    scale = d**-0.5
    if layout == "contiguous":
        starts = torch.arange(BATCH, dtype=torch.int64, device=device) * context
        return triton_attention.contiguous_attention, (
            query, k_cache, v_cache, starts, lens, cu, scale
        )
    block_size = int(layout.split("-")[1])
    # Blocks scattered over the pool, as after many allocations and frees.
    order = np.random.default_rng(0).permutation(num_slots // block_size)
    tables = torch.tensor(order.reshape(BATCH, -1), dtype=torch.int32, device=device)
    return triton_attention.paged_attention, (
        query, k_cache, v_cache, tables, lens, cu, block_size, scale
    )


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_attention(benchmark, gpu, layout, context):
    from triton.testing import do_bench

    fn, args = _inputs(layout, context)
    kv_bytes = 2 * BATCH * context * MODEL.num_kv_heads * MODEL.head_dim * DTYPE.itemsize

    def call():
        return fn(*args)

    def call_and_wait():
        out = call()
        torch.cuda.synchronize()
        return out

    device_s = do_bench(call, return_mode="median") / 1e3
    benchmark.group = f"decode context={context}"
    benchmark.extra_info.update(
        layout=layout, context=context, batch=BATCH, model=MODEL.name, dtype=str(DTYPE),
        gpu=gpu.name, kv_read_bytes=kv_bytes, device_us=device_s * 1e6,
        kv_read_bytes_per_s=kv_bytes / device_s,
        pct_of_peak_hbm=100 * kv_bytes / device_s / gpu.hbm_bytes_per_s,
        peak_hbm_bytes_per_s=gpu.hbm_bytes_per_s,
    )
    out = benchmark.pedantic(call_and_wait, rounds=30, warmup_rounds=3)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
