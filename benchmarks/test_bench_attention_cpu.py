"""Micro-benchmarks of the reference attention on CPU: paged versus contiguous KV layouts.

Run with ``OMP_NUM_THREADS=1 pytest benchmarks/test_bench_attention_cpu.py --benchmark-only``;
it is outside the test suite's ``testpaths``. Head shapes are the ``tiny`` preset's (8 query
heads over 2 KV heads of 32) and a 7B-class model's (``mistral-7b``: 32 over 8 of 128), in
float32, the CPU engine's dtype.

Layouts: ``contiguous`` (one extent per sequence), ``paged`` (each sequence's blocks
physically consecutive, as a fresh pool hands them out) and ``paged-scattered`` (blocks
permuted over the whole pool, as after many allocations and frees). Decode batches have all
sequences at ``context`` (``equal``) or spread evenly from ``context / 8`` to ``context``
(``ragged``); a prefill step is one chunk of 256 queries on top of ``context - 256`` cached
tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.engines.presets import get_preset
from kvbench.kernels import reference

HEADS = {"tiny": get_preset("tiny"), "7b": get_preset("mistral-7b")}
BLOCK_SIZE = 16
PREFILL_CHUNK = 256
LAYOUTS = ("contiguous", "paged", "paged-scattered")


def _inputs(layout: str, heads: str, q_lens: list[int], ctx_lens: list[int]):
    preset = HEADS[heads]
    hkv, d = preset.num_kv_heads, preset.head_dim
    gen = torch.Generator().manual_seed(0)
    num_seqs = len(ctx_lens)
    blocks = [-(-n // BLOCK_SIZE) for n in ctx_lens]
    num_slots = sum(blocks) * BLOCK_SIZE
    k_cache = torch.randn(num_slots, hkv, d, generator=gen)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen)
    query = torch.randn(sum(q_lens), preset.num_heads, d, generator=gen)
    cu = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = d**-0.5
    first = np.cumsum([0, *blocks])
    if layout == "contiguous":
        starts = torch.tensor(first[:-1] * BLOCK_SIZE, dtype=torch.int64)
        return reference.contiguous_attention, (query, k_cache, v_cache, starts, lens, cu, scale)
    ids = np.arange(first[-1])
    if layout == "paged-scattered":
        ids = np.random.default_rng(0).permutation(ids)
    tables = torch.zeros(num_seqs, max(blocks), dtype=torch.int32)
    for b in range(num_seqs):
        tables[b, : blocks[b]] = torch.from_numpy(ids[first[b] : first[b + 1]])
    return reference.paged_attention, (
        query, k_cache, v_cache, tables, lens, cu, BLOCK_SIZE, scale
    )


def _run(benchmark, fn, args, **info) -> None:
    benchmark.extra_info.update(info, threads=torch.get_num_threads())
    with torch.inference_mode():
        out = benchmark(fn, *args)
    assert out.shape == args[0].shape and torch.isfinite(out).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lengths", ["equal", "ragged"])
@pytest.mark.parametrize("context", [256, 1024, 4096])
@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize("heads", list(HEADS))
def test_decode(benchmark, heads, batch, context, lengths, layout):
    if lengths == "equal":
        ctx = [context] * batch
    else:
        ctx = np.linspace(context // 8, context, batch).astype(int).tolist()
    fn, args = _inputs(layout, heads, [1] * batch, ctx)
    benchmark.group = f"decode {heads} batch={batch} context={context} {lengths}"
    _run(benchmark, fn, args, layout=layout, heads=heads, batch=batch, context=context,
         lengths=lengths)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("context", [256, 1024, 4096])
@pytest.mark.parametrize("heads", list(HEADS))
def test_prefill(benchmark, heads, context, layout):
    fn, args = _inputs(layout, heads, [PREFILL_CHUNK], [context])
    benchmark.group = f"prefill {heads} chunk={PREFILL_CHUNK} context={context}"
    _run(benchmark, fn, args, layout=layout, heads=heads, context=context)
