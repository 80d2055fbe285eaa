"""Micro-benchmarks of the CPU attention kernels: paged versus contiguous KV layouts, the torch
reference and (decodes) the native C kernel (``kernel``), which reads both layouts in place.

Run with ``OMP_NUM_THREADS=1 pytest benchmarks/test_bench_attention_cpu.py --benchmark-only``;
it is outside the test suite's ``testpaths``. Head shapes are the ``tiny`` preset's (8 query
heads over 2 KV heads of 32) and a 7B-class model's (``mistral-7b``: 32 over 8 of 128), in
float32, the CPU engine's dtype.

Layouts: ``contiguous`` (one extent per sequence), ``paged`` (each sequence's blocks
physically consecutive, as a fresh pool hands them out), ``paged-recycled`` (consecutive but
descending, as a pool that takes freed blocks back tail first hands them out again) and
``paged-scattered`` (blocks permuted over the whole pool, the worst case). Decode batches have all
sequences at ``context`` (``equal``) or spread evenly from ``context / 8`` to ``context``
(``ragged``); a prefill step is one chunk of 256 queries on top of ``context - 256`` cached
tokens.

``test_quantised_*`` price dequantisation: the same paged attention over int8 and float8
pages (one scale per block and KV head) against float32, and the store of a decode step or a
prefill chunk, whose quantised form includes the scale updates and requantisation.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from kvbench.engines.model.presets import get_preset
from kvbench.kernels import cpu_native, reference

HEADS = {"tiny": get_preset("tiny"), "7b": get_preset("mistral-7b")}
BLOCK_SIZE = 16
PREFILL_CHUNK = 256
LAYOUTS = ("contiguous", "paged", "paged-recycled", "paged-scattered")
KV_DTYPES = {"float32": torch.float32, "int8": torch.int8, "float8": torch.float8_e4m3fn}


def _quantised(k_cache: torch.Tensor, v_cache: torch.Tensor, kv: str):
    """int8 or float8 pages of the float caches, through the store, one scale per block."""
    dtype = KV_DTYPES[kv]
    codes = [torch.empty(k_cache.shape, dtype=dtype) for _ in range(2)]
    scales = [torch.zeros(k_cache.shape[0] // BLOCK_SIZE, k_cache.shape[1]) for _ in range(2)]
    reference.store_kv(*codes, k_cache, v_cache, torch.arange(k_cache.shape[0]),
                       k_scale=scales[0], v_scale=scales[1])
    return codes, dict(k_scale=scales[0], v_scale=scales[1])


def _inputs(layout: str, heads: str, q_lens: list[int], ctx_lens: list[int],
            kv: str = "float32", kernels=reference):
    preset = HEADS[heads]
    hkv, d = preset.num_kv_heads, preset.head_dim
    gen = torch.Generator().manual_seed(0)
    num_seqs = len(ctx_lens)
    blocks = [-(-n // BLOCK_SIZE) for n in ctx_lens]
    num_slots = sum(blocks) * BLOCK_SIZE
    k_cache = torch.randn(num_slots, hkv, d, generator=gen)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen)
    paged_fn, scales = kernels.paged_attention, {}
    if kv != "float32":
        (k_cache, v_cache), scales = _quantised(k_cache, v_cache, kv)
        paged_fn = partial(reference.paged_attention, **scales)
    query = torch.randn(sum(q_lens), preset.num_heads, d, generator=gen)
    cu = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = d**-0.5
    first = np.cumsum([0, *blocks])
    if layout == "contiguous":
        starts = torch.tensor(first[:-1] * BLOCK_SIZE, dtype=torch.int64)
        return kernels.contiguous_attention, (query, k_cache, v_cache, starts, lens, cu, scale)
    ids = np.arange(first[-1])
    if layout == "paged-scattered":
        ids = np.random.default_rng(0).permutation(ids)
    tables = torch.zeros(num_seqs, max(blocks), dtype=torch.int32)
    for b in range(num_seqs):
        own = ids[first[b] : first[b + 1]]
        tables[b, : blocks[b]] = torch.from_numpy(own[::-1].copy() if layout == "paged-recycled"
                                                  else own)
    return paged_fn, (query, k_cache, v_cache, tables, lens, cu, BLOCK_SIZE, scale)


def _run(benchmark, fn, args, **info) -> None:
    benchmark.extra_info.update(info, threads=torch.get_num_threads())
    with torch.inference_mode():
        out = benchmark(fn, *args)
    assert out.shape == args[0].shape and torch.isfinite(out).all()


@pytest.mark.parametrize("kernel", ["reference", "native"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lengths", ["equal", "ragged"])
@pytest.mark.parametrize("context", [256, 1024, 4096])
@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize("heads", list(HEADS))
def test_decode(benchmark, heads, batch, context, lengths, layout, kernel):
    if kernel == "native" and not cpu_native.available():
        pytest.skip("the native kernel needs a C compiler")
    if lengths == "equal":
        ctx = [context] * batch
    else:
        ctx = np.linspace(context // 8, context, batch).astype(int).tolist()
    fn, args = _inputs(layout, heads, [1] * batch, ctx,
                       kernels=cpu_native if kernel == "native" else reference)
    benchmark.group = f"decode {heads} batch={batch} context={context} {lengths}"
    _run(benchmark, fn, args, layout=layout, heads=heads, batch=batch, context=context,
         lengths=lengths, kernel=kernel)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("context", [256, 1024, 4096])
@pytest.mark.parametrize("heads", list(HEADS))
def test_prefill(benchmark, heads, context, layout):
    fn, args = _inputs(layout, heads, [PREFILL_CHUNK], [context])
    benchmark.group = f"prefill {heads} chunk={PREFILL_CHUNK} context={context}"
    _run(benchmark, fn, args, layout=layout, heads=heads, context=context)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize(("batch", "context"), [(16, 1024), (16, 4096), (64, 1024)])
@pytest.mark.parametrize("heads", list(HEADS))
def test_quantised_decode(benchmark, heads, batch, context, kv):
    fn, args = _inputs("paged", heads, [1] * batch, [context] * batch, kv)
    benchmark.group = f"quantised decode {heads} batch={batch} context={context}"
    _run(benchmark, fn, args, kv=kv, heads=heads, batch=batch, context=context)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("context", [1024, 4096])
@pytest.mark.parametrize("heads", list(HEADS))
def test_quantised_prefill(benchmark, heads, context, kv):
    fn, args = _inputs("paged", heads, [PREFILL_CHUNK], [context], kv)
    benchmark.group = f"quantised prefill {heads} chunk={PREFILL_CHUNK} context={context}"
    _run(benchmark, fn, args, kv=kv, heads=heads, context=context)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize(("phase", "tokens"), [("decode", 64), ("prefill", PREFILL_CHUNK)])
@pytest.mark.parametrize("heads", list(HEADS))
def test_quantised_store(benchmark, heads, phase, tokens, kv):
    """One step's store into a pool of 4096 blocks: a decode appends one token to each of 64
    sequences (at offset 5 of their last block, the block already holding smaller values so
    that scales rise and blocks requantise); a prefill fills 16 fresh blocks."""
    preset = HEADS[heads]
    shape = (4096 * BLOCK_SIZE, preset.num_kv_heads, preset.head_dim)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = 0.25 * torch.randn(shape, generator=gen), 0.25 * torch.randn(shape,
                                                                                 generator=gen)
    scales = {}
    if kv != "float32":
        (k_cache, v_cache), scales = _quantised(k_cache, v_cache, kv)
    key = torch.randn(tokens, *shape[1:], generator=gen)
    value = torch.randn(tokens, *shape[1:], generator=gen)
    if phase == "decode":
        slots = torch.randperm(4096, generator=gen)[:tokens] * BLOCK_SIZE + 5
    else:
        slots = torch.arange(tokens) + 100 * BLOCK_SIZE
    benchmark.group = f"quantised store {heads} {phase} tokens={tokens}"
    benchmark.extra_info.update(kv=kv, heads=heads, phase=phase, tokens=tokens,
                                threads=torch.get_num_threads())
    saved = [t.clone() for t in (k_cache, v_cache, *scales.values())]

    def setup():
        # Every round stores into the same state, so every decode round rises and requantises.
        for t, s in zip((k_cache, v_cache, *scales.values()), saved, strict=True):
            t.copy_(s)
        return (k_cache, v_cache, key, value, slots), scales

    with torch.inference_mode():
        benchmark.pedantic(reference.store_kv, setup=setup, rounds=20)
