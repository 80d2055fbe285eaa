"""Micro-benchmarks of the reference attention on CPU: paged (block-table gather) versus
contiguous (extent slices), for a decode batch and a prefill chunk at several context lengths.

Run with ``pytest benchmarks/test_bench_attention_cpu.py --benchmark-only``; it is outside the
test suite's ``testpaths``. Shapes are the ``tiny`` preset's attention (8 query heads, 2 KV
heads, head_dim 32, float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.engines.presets import get_preset
from kvbench.kernels import reference

TINY = get_preset("tiny")
BLOCK_SIZE = 16
DECODE_SEQS = 16
PREFILL_CHUNK = 256


def _inputs(layout: str, phase: str, context: int):
    num_seqs, q_len = (DECODE_SEQS, 1) if phase == "decode" else (1, PREFILL_CHUNK)
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_slots = num_seqs * blocks_per_seq * BLOCK_SIZE
    k_cache = torch.randn(num_slots, TINY.num_kv_heads, TINY.head_dim, generator=gen)
    v_cache = torch.randn(num_slots, TINY.num_kv_heads, TINY.head_dim, generator=gen)
    query = torch.randn(num_seqs * q_len, TINY.num_heads, TINY.head_dim, generator=gen)
    cu = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    scale = TINY.head_dim**-0.5
    if layout == "paged":
        # Blocks scattered over the pool, as after many allocations and frees.
        order = np.random.default_rng(0).permutation(num_seqs * blocks_per_seq)
        tables = torch.tensor(order.reshape(num_seqs, blocks_per_seq), dtype=torch.int32)
        return reference.paged_attention, (
            query, k_cache, v_cache, tables, lens, cu, BLOCK_SIZE, scale
        )
    starts = torch.arange(num_seqs, dtype=torch.int64) * blocks_per_seq * BLOCK_SIZE
    return reference.contiguous_attention, (query, k_cache, v_cache, starts, lens, cu, scale)


@pytest.mark.parametrize("context", [256, 1024, 4096])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_attention(benchmark, layout, phase, context):
    fn, args = _inputs(layout, phase, context)
    benchmark.group = f"{phase} context={context}"
    benchmark.extra_info.update(layout=layout, context=context, threads=torch.get_num_threads())
    with torch.inference_mode():
        out = benchmark(fn, *args)
    assert out.shape == args[0].shape
