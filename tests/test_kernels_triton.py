"""The Triton kernels against the torch reference.

Kernel tests run on CUDA when there is a device. On a CPU they run in the Triton interpreter,
which is chosen when triton's decorators run (TRITON_INTERPRET=1 must be set before the
kernels are imported), so ``test_interpreter`` runs this file again in a child pytest with
the variable set; this process never turns the interpreter on for other tests. Shapes are
tiny: the interpreter runs every program of a grid one after another in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbench.errors import KvbenchError
from kvbench.kernels import reference
from kvbench.kernels.backend import get_backend
from kvbench.kernels.slot_copy import SlotCopy

HAS_TRITON = find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETING else "cuda" if torch.cuda.is_available() else None
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# Tests of backend selection run once, in the parent process.
parent_only = pytest.mark.skipif(INTERPRETING, reason="runs in the parent process")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
kernel_test = pytest.mark.skipif(
    not HAS_TRITON or DEVICE is None,
    reason="needs triton and CUDA; on a CPU these run in test_interpreter's child process",
)


def triton_backend():
    return get_backend("triton", DEVICE)


@dataclass
class Batch:
    """A ragged batch whose KV sits in a paged and a contiguous cache (the same values),
    with random data in every slot no sequence owns, so a wrong address shows."""

    query: torch.Tensor
    cu: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    block_tables: torch.Tensor
    paged_k: torch.Tensor
    paged_v: torch.Tensor
    extent_starts: torch.Tensor
    cont_k: torch.Tensor
    cont_v: torch.Tensor
    scale: float

    def paged(self, fn, **kw) -> torch.Tensor:
        return fn(
            self.query, self.paged_k, self.paged_v, self.block_tables, self.context_lens,
            self.cu, self.block_size, self.scale, **kw,
        )

    def contiguous(self, fn, **kw) -> torch.Tensor:
        return fn(
            self.query, self.cont_k, self.cont_v, self.extent_starts, self.context_lens,
            self.cu, self.scale, **kw,
        )


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    block_size: int = 16,
    group: int = 1,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    num_seqs = len(ctx_lens)
    keys = [randn(n, num_kv_heads, head_dim) for n in ctx_lens]
    values = [randn(n, num_kv_heads, head_dim) for n in ctx_lens]
    # Paged: blocks in shuffled order, table rows padded with -1 past each sequence's blocks.
    need = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(need) + 2
    order = rng.permutation(num_blocks)
    tables = torch.full((num_seqs, max(need, default=1)), -1, dtype=torch.int32)
    paged_k = randn(num_blocks * block_size, num_kv_heads, head_dim)
    paged_v = randn(num_blocks * block_size, num_kv_heads, head_dim)
    # Contiguous: extents in reverse order with gaps between them.
    starts, cursor = [0] * num_seqs, 3
    for b in reversed(range(num_seqs)):
        starts[b], cursor = cursor, cursor + ctx_lens[b] + 2
    cont_k = randn(cursor, num_kv_heads, head_dim)
    cont_v = randn(cursor, num_kv_heads, head_dim)
    used = 0
    for b, n in enumerate(ctx_lens):
        blocks = torch.tensor(order[used : used + need[b]], dtype=torch.int32)
        used += need[b]
        tables[b, : need[b]] = blocks
        pos = torch.arange(n)
        slots = (blocks.long()[pos // block_size] * block_size + pos % block_size).to(DEVICE)
        paged_k[slots], paged_v[slots] = keys[b], values[b]
        cont_k[starts[b] : starts[b] + n], cont_v[starts[b] : starts[b] + n] = keys[b], values[b]
    return Batch(
        query=randn(sum(q_lens), num_kv_heads * group, head_dim),
        cu=torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        block_size=block_size,
        block_tables=tables.to(DEVICE),
        paged_k=paged_k, paged_v=paged_v,
        extent_starts=torch.tensor(starts, dtype=torch.int64, device=DEVICE),
        cont_k=cont_k, cont_v=cont_v,
        scale=head_dim**-0.5,
    )


def check_attention(batch: Batch, window: int | None = None, **kw) -> None:
    """Both layouts' Triton output against the reference, in the query's dtype."""
    tr = triton_backend()
    if window is not None:
        kw["window"] = window
    want = batch.paged(reference.paged_attention, window=window)
    tol = TOL[batch.query.dtype]
    for got in (batch.paged(tr.paged_attention, **kw),
                batch.contiguous(tr.contiguous_attention, **kw)):
        assert got.dtype == batch.query.dtype and got.shape == batch.query.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@kernel_test
@pytest.mark.parametrize(
    ("block_size", "group"), [(8, 1), (8, 4), (8, 8), (16, 1), (16, 8), (256, 4)]
)
def test_decode_at_block_edges(block_size, group):
    """Context 1, exactly full blocks, one token past a boundary, ragged in one batch."""
    ctx = [1, block_size, block_size + 1, 2 * block_size, 3]
    check_attention(
        make_batch([1] * len(ctx), ctx, block_size=block_size, group=group, num_kv_heads=1)
    )


@kernel_test
@pytest.mark.parametrize(("block_size", "group"), [(8, 1), (16, 4), (8, 7)])
def test_mixed_prefill_and_decode(block_size, group):
    """A later prefill chunk on cached KV, decodes, a first chunk, a chunk ending on a block
    boundary; group 7 is a non-power-of-two GQA group (Qwen2.5-7B)."""
    q_lens, ctx = [5, 1, 20, 1, 9], [21, 33, 20, 2, 2 * block_size]
    kv_heads = 2 if group == 4 else 1  # one case covers KV-head addressing
    check_attention(
        make_batch(q_lens, ctx, block_size=block_size, group=group, num_kv_heads=kv_heads)
    )


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    check_attention(make_batch([1, 7, 1], [9, 7, 40], group=4, dtype=dtype))


@pytest.fixture
def short_splits(monkeypatch):
    """Let splits engage on contexts the interpreter runs quickly."""
    from kvbench.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "MIN_SPLIT_TOKENS", 16)


@kernel_test
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_decode(short_splits, num_splits):
    """Long contexts shared by several programs and combined; a short context whose later
    splits have nothing to read; a head size that is not a power of two."""
    batch = make_batch([1, 1, 1], [150, 3, 65], block_size=16, group=4, num_kv_heads=1,
                       head_dim=24)
    check_attention(batch, num_splits=num_splits)


@kernel_test
def test_split_k_prefill(short_splits):
    """Splitting is only chosen for decodes, but stays exact for prefill chunks."""
    check_attention(make_batch([3, 1], [100, 40], block_size=8, num_kv_heads=1), num_splits=2)


@kernel_test
@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window(short_splits, window):
    """Decodes past the window and prefill chunks straddling it, with and without split-K;
    the tiles wholly before a window are skipped, the one it starts in masked."""
    q_lens, ctx = [1, 9, 1, 20, 1], [150, 60, 3, 20, 65]
    batch = make_batch(q_lens, ctx, block_size=16, group=4, num_kv_heads=1)
    check_attention(batch, window=window)
    decodes = make_batch([1, 1, 1], [150, 3, 65], block_size=16, group=4, num_kv_heads=1)
    check_attention(decodes, window=window, num_splits=3)


@kernel_test
def test_chunked_prefill_equals_one_shot():
    """Chunks of one prompt, each attending to all earlier positions, give the rows of one
    full prefill."""
    full = make_batch([24], [24], block_size=8, group=4)
    tr = triton_backend()
    one_shot = full.paged(tr.paged_attention)
    rows = []
    for start, end in [(0, 10), (10, 11), (11, 24)]:
        rows.append(tr.paged_attention(
            full.query[start:end], full.paged_k, full.paged_v, full.block_tables,
            torch.tensor([end], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE), 8, full.scale,
        ))
    torch.testing.assert_close(torch.cat(rows), one_shot, atol=1e-6, rtol=1e-6)


@kernel_test
def test_empty_batch():
    tr = triton_backend()
    batch = make_batch([], [])
    assert batch.paged(tr.paged_attention).shape == (0, 2, 16)
    assert batch.contiguous(tr.contiguous_attention).shape == (0, 2, 16)
    k_cache = torch.zeros(4, 2, 16, device=DEVICE)
    empty = torch.zeros(0, 2, 16, device=DEVICE)
    tr.store_kv(k_cache, k_cache.clone(), empty, empty, torch.zeros(0, dtype=torch.int64,
                                                                     device=DEVICE))
    tr.copy_slots(k_cache[None], [])
    assert not k_cache.any()


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_into_pool_views(dtype):
    """The executor's pool is [layers, 2, slots, H, D]; per-layer K/V are views into it."""
    pool = torch.zeros(3, 2, 12, 2, 16, dtype=dtype, device=DEVICE)
    want = pool.clone()
    key = torch.randn(4, 2, 16, device=DEVICE).to(dtype)
    value = torch.randn(4, 2, 16, device=DEVICE).to(dtype)
    slots = torch.tensor([7, 2, 11, 0], device=DEVICE)
    reference.store_kv(want[1, 0], want[1, 1], key, value, slots)
    triton_backend().store_kv(pool[1, 0], pool[1, 1], key, value, slots)
    assert torch.equal(pool, want)


COPY_CASES = {
    "slide-left": [SlotCopy(src=4, dst=1, num_slots=6)],
    "slide-right": [SlotCopy(src=1, dst=4, num_slots=6)],
    "chained": [SlotCopy(src=0, dst=8, num_slots=3), SlotCopy(src=8, dst=12, num_slots=3)],
    "copy-on-write": [SlotCopy(src=0, dst=16, num_slots=4), SlotCopy(src=4, dst=20, num_slots=4),
                      SlotCopy(src=8, dst=24, num_slots=4)],
    "swap-through-third": [SlotCopy(src=0, dst=20, num_slots=5), SlotCopy(src=10, dst=0,
                                                                          num_slots=5),
                           SlotCopy(src=20, dst=10, num_slots=5)],
    "compaction": [SlotCopy(src=5, dst=0, num_slots=7), SlotCopy(src=14, dst=7, num_slots=9),
                   SlotCopy(src=26, dst=16, num_slots=3)],
}


@kernel_test
@pytest.mark.parametrize("copies", COPY_CASES.values(), ids=COPY_CASES.keys())
def test_copy_slots(copies):
    caches = torch.randn(4, 32, 2, 3, device=DEVICE)
    want = caches.clone()
    reference.copy_slots(want, copies)
    triton_backend().copy_slots(caches, copies)
    assert torch.equal(caches, want)


@kernel_test
@pytest.mark.parametrize("copy", [SlotCopy(src=9, dst=2, num_slots=20),
                                  SlotCopy(src=2, dst=9, num_slots=20)])
def test_copy_slots_staged_in_pieces(monkeypatch, copy):
    """A long overlapping slide moves through a staging buffer smaller than itself, each
    piece by one program looping over it."""
    from kvbench.kernels import triton_kv

    caches = torch.randn(2, 32, 2, 3, device=DEVICE)
    row_bytes = 2 * 2 * 3 * caches.element_size()
    monkeypatch.setattr(triton_kv, "STAGING_BYTES", 6 * row_bytes)  # pieces of 6 slots
    monkeypatch.setattr(triton_kv, "COPY_SLOTS", 2)
    monkeypatch.setattr(triton_kv, "MAX_COPY_PROGRAMS", 1)
    want = caches.clone()
    reference.copy_slots(want, [copy])
    triton_kv.copy_slots(caches, [copy])
    assert torch.equal(caches, want)


QDTYPES = [torch.int8, *([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])]


def quantised(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, group: int):
    """Codes and scales of float caches ``k``/``v``, written by the reference store (every
    slot at once, so each group fits its own values)."""
    num_slots, heads, _ = k.shape
    codes_k, codes_v = torch.zeros_like(k).to(dtype), torch.zeros_like(v).to(dtype)
    k_scale = torch.zeros(num_slots // group, heads, device=k.device)
    v_scale = torch.zeros_like(k_scale)
    reference.store_kv(codes_k, codes_v, k.float(), v.float(),
                       torch.arange(num_slots, device=k.device), k_scale=k_scale, v_scale=v_scale)
    return codes_k, codes_v, k_scale, v_scale


def check_quantised(batch: Batch, dtype: torch.dtype, paged_group: int, **kw) -> None:
    """Triton over int8/fp8 pages (paged: ``paged_group`` slots per scale; contiguous: one
    scale per slot) against the reference over the same codes."""
    tr = triton_backend()
    tol = TOL[batch.query.dtype]
    pk, pv, pks, pvs = quantised(batch.paged_k, batch.paged_v, dtype, paged_group)
    ck, cv, cks, cvs = quantised(batch.cont_k, batch.cont_v, dtype, 1)
    paged = dict(query=batch.query, k_cache=pk, v_cache=pv, block_tables=batch.block_tables,
                 context_lens=batch.context_lens, cu_seqlens_q=batch.cu,
                 block_size=batch.block_size, scale=batch.scale, k_scale=pks, v_scale=pvs)
    cont = dict(query=batch.query, k_cache=ck, v_cache=cv, extent_starts=batch.extent_starts,
                context_lens=batch.context_lens, cu_seqlens_q=batch.cu, scale=batch.scale,
                k_scale=cks, v_scale=cvs)
    for fn, ref, args in ((tr.paged_attention, reference.paged_attention, paged),
                          (tr.contiguous_attention, reference.contiguous_attention, cont)):
        want, want_lse = ref(**args, return_lse=True)
        got, got_lse = fn(**args, return_lse=True, **kw)
        assert got.dtype == batch.query.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(got_lse, want_lse, atol=tol, rtol=tol)


@kernel_test
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize(("block_size", "paged_group", "group"), [(8, 8, 4), (16, 4, 1), (8, 8, 7)])
def test_quantised_attention(dtype, block_size, paged_group, group):
    """Decodes, a later prefill chunk and a first chunk over quantised pages; per-block and
    sub-block scale groups; GQA groups of 4, 1 and 7."""
    batch = make_batch([1, 5, 1, 9], [21, 19, 2, 9], block_size=block_size, group=group,
                       num_kv_heads=2 if group == 4 else 1)
    check_quantised(batch, dtype, paged_group)


@kernel_test
@pytest.mark.parametrize("dtype", QDTYPES)
def test_quantised_split_k_decode(short_splits, dtype):
    batch = make_batch([1, 1], [70, 3], block_size=16, group=4, num_kv_heads=1)
    check_quantised(batch, dtype, 16, num_splits=3)


@kernel_test
@pytest.mark.parametrize("qdtype", [torch.float16, torch.bfloat16])
def test_quantised_with_half_precision_queries(qdtype):
    check_quantised(make_batch([1, 7], [9, 30], group=4, dtype=qdtype), torch.int8, 16)


@kernel_test
@pytest.mark.parametrize("num_splits", [1, 3])
def test_lse_matches_the_reference(short_splits, num_splits):
    batch = make_batch([1, 1, 1], [50, 1, 33], block_size=8, group=4, num_kv_heads=1)
    tr = triton_backend()
    want, want_lse = batch.paged(reference.paged_attention, return_lse=True)
    for fn, call in ((tr.paged_attention, batch.paged), (tr.contiguous_attention,
                                                          batch.contiguous)):
        got, got_lse = call(fn, return_lse=True, num_splits=num_splits)
        torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
        torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize("quant", [None, torch.int8])
def test_positions_and_merge_match_the_reference(quant):
    """Two pools holding alternate stretches of one sequence's positions, each attended with
    key positions and merged, with queries before, inside and after the stretches."""
    tr = triton_backend()
    length, block_size = 40, 8
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(length, 2, 16, generator=gen).to(DEVICE)
    v = torch.randn(length, 2, 16, generator=gen).to(DEVICE)
    q_pos = torch.tensor([3, 12, 13, 25, 39], dtype=torch.int32, device=DEVICE)
    query = torch.randn(5, 8, 16, generator=gen).to(DEVICE)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    results = {}
    for name, keep in (("a", lambda p: (p // 10) % 2 == 0), ("b", lambda p: (p // 10) % 2 == 1)):
        pos = [p for p in range(length) if keep(p)]
        num_slots = 4 * block_size
        pk, pv = torch.zeros(num_slots, 2, 16, device=DEVICE), torch.zeros(num_slots, 2, 16,
                                                                          device=DEVICE)
        table = torch.tensor([[3, 0, 2, 1]], dtype=torch.int32, device=DEVICE)
        slots = (table[0].long()[torch.arange(len(pos), device=DEVICE) // block_size] *
                 block_size + torch.arange(len(pos), device=DEVICE) % block_size)
        pk[slots], pv[slots] = k[pos], v[pos]
        slot_pos = torch.full((num_slots,), -1, dtype=torch.int32, device=DEVICE)
        slot_pos[slots] = torch.tensor(pos, dtype=torch.int32, device=DEVICE)
        extra = {}
        if quant is not None:
            pk, pv, ks, vs = quantised(pk, pv, quant, block_size)
            extra = dict(k_scale=ks, v_scale=vs)
        args = (query, pk, pv, table, torch.tensor([len(pos)], dtype=torch.int32,
                                                   device=DEVICE), cu, block_size, 0.25)
        kw = dict(slot_positions=slot_pos, query_positions=q_pos, return_lse=True, **extra)
        want = reference.paged_attention(*args, **kw)
        got = tr.paged_attention(*args, **kw)
        torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=2e-5)
        results[name] = got
    assert (results["b"][1][0] == float("-inf")).all()  # position 3 precedes pool b
    want_o, want_lse = reference.merge_attention(*results["a"], *results["b"], return_lse=True)
    got_o, got_lse = tr.merge_attention(*results["a"], *results["b"], return_lse=True)
    torch.testing.assert_close(got_o, want_o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-6)
    half = tr.merge_attention(results["a"][0].bfloat16(), results["a"][1],
                              results["b"][0].bfloat16(), results["b"][1])
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want_o, atol=2e-2, rtol=2e-2)


@kernel_test
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_quantised_store_matches_the_reference(dtype, group):
    """The same appends (prefill chunks and decodes, magnitudes rising so that scales rise
    and groups requantise) through both stores: equal scales, codes within one step."""
    gen = torch.Generator().manual_seed(6)
    num_slots = 32
    stores = {"ref": reference.store_kv, "triton": triton_backend().store_kv}
    state = {
        name: ([torch.zeros(num_slots, 2, 16, device=DEVICE).to(dtype) for _ in range(2)],
               [torch.zeros(num_slots // group, 2, device=DEVICE) for _ in range(2)])
        for name in stores
    }
    start = 0
    for n, mag in ((5, 1.0), (1, 3.0), (1, 0.5), (3, 20.0), (1, 1.0), (6, 0.1)):
        slots = torch.arange(start, start + n, device=DEVICE)
        start += n
        key = mag * torch.randn(n, 2, 16, generator=gen).to(DEVICE)
        value = mag * torch.randn(n, 2, 16, generator=gen).to(DEVICE)
        for name, store in stores.items():
            (kc, vc), (ks, vs) = state[name]
            store(kc, vc, key, value, slots, k_scale=ks, v_scale=vs)
    (rk, rv), (rks, rvs) = state["ref"]
    (tk, tv), (tks, tvs) = state["triton"]
    assert torch.equal(tks, rks) and torch.equal(tvs, rvs)
    for got, want in ((tk, rk), (tv, rv)):
        step = (got.float() - want.float()).abs()
        if dtype == torch.int8:
            assert step.max() <= 1 and (step == 0).float().mean() > 0.99
        else:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@kernel_test
@pytest.mark.parametrize("dtype", QDTYPES)
def test_copy_slots_moves_scales(dtype):
    caches = torch.randn(4, 32, 2, 3, device=DEVICE).to(dtype)
    scales = torch.rand(4, 8, 2, device=DEVICE)
    copies = COPY_CASES["copy-on-write"] + [SlotCopy(src=20, dst=8, num_slots=8)]
    want, want_scales = caches.clone(), scales.clone()
    reference.copy_slots(want, copies, want_scales)
    triton_backend().copy_slots(caches, copies, scales)
    assert torch.equal(caches.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    with pytest.raises(KvbenchError, match="scale-group boundaries"):
        triton_backend().copy_slots(caches, [SlotCopy(src=2, dst=8, num_slots=4)], scales)


@kernel_test
@pytest.mark.skipif(DEVICE != "cpu", reason="the model driver builds its batches on the CPU")
def test_model_generates_the_reference_tokens():
    """The decoder on the Triton backend, paged: chunked prefill, then batched decodes."""
    from model_driver import SMALL, Runner, prompts

    from kvbench.engines.model.weights import build_model

    tokens = [
        Runner(build_model(SMALL, kernels, torch.device("cpu"), seed=0), "paged", num_seqs=2)
        .generate(prompts([5, 12]), steps=3, chunk=8)
        for kernels in (get_backend("reference"), triton_backend())
    ]
    assert tokens[0] == tokens[1]


@kernel_test
@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes are too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_real_shapes_on_cuda(dtype, block_size):
    """Llama-3-8B attention shapes: 32 query heads over 8 KV heads of 128, long ragged
    decodes with the default split, and a batch with prefill chunks."""
    ctx = [4096, 1, 17, 1000, 5000, 2048, 256, 257] * 2
    decode = make_batch([1] * len(ctx), ctx, block_size=block_size, group=4, num_kv_heads=8,
                        head_dim=128, dtype=dtype)
    check_attention(decode)
    mixed = make_batch([512, 1, 300, 1], [3000, 4000, 300, 77], block_size=block_size,
                       group=4, num_kv_heads=8, head_dim=128, dtype=dtype)
    check_attention(mixed)


@needs_triton
@parent_only
def test_interpreter():
    """Every kernel test in this file, on CPU, in a child pytest under the Triton
    interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@needs_triton
@parent_only
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    with pytest.raises(KvbenchError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")


@parent_only
def test_missing_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with pytest.raises(KvbenchError, match="needs the triton package"):
        get_backend("triton")
    assert get_backend("auto", "cuda").name == "reference"


@parent_only
def test_auto_and_unknown_backends():
    # On the CPU, auto is the native kernel where it builds (tests/test_kernels_native.py).
    assert get_backend("auto", "cpu").name in ("native", "reference")
    assert get_backend("auto").name == "reference"
    with pytest.raises(KvbenchError, match="valid backends: auto, native, reference, triton"):
        get_backend("flash")


@parent_only
def test_reference_path_never_imports_triton():
    code = (
        "import sys; from kvbench.kernels.backend import get_backend; "
        "get_backend('reference', 'cpu'); get_backend('auto', 'cpu'); "
        "sys.exit('triton' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@kernel_test
def test_modal_class_pools_match_the_reference():
    """The executor's pool of page classes (float32 text, int8 vision, separate caches,
    attention merged over the classes) gives the same step with Triton as with the
    reference: prefill then a decode over text, image and text positions."""
    from kvbench.engines.builtin.scheduler import SchedulerConfig
    from kvbench.engines.config import EngineSettings, engine_config
    from kvbench.engines.kv.class_pools import ClassPools
    from kvbench.engines.kv.modal import ModalPolicy
    from kvbench.engines.model.presets import ModelPreset
    from kvbench.engines.sequence import Sequence
    from kvbench.run.devices import parse_device
    from kvbench.workloads.model import Request, Segment

    preset = ModelPreset(name="m", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=256,
                         dtype="float32")
    policy = ModalPolicy(vision_page_tokens=16, kv_dtype={"image": "int8"})
    settings = EngineSettings(preset=preset, device=parse_device("cpu"),
                              kv_bytes=512 * preset.kv_bytes_per_token, block_size=8,
                              prefix_caching=False, scheduler=SchedulerConfig(256, 4, 256, True))
    cfg = engine_config("m", policy, settings)
    kv = cfg.section.manager(cfg)
    req = Request("r", 0.0, (Segment("text", 5, "t"), Segment("image", 20, "i"),
                             Segment("text", 6, "q")), 2)
    seq = Sequence(0, req, req.prompt_token_ids(64))
    n = seq.num_prompt_tokens
    assert kv.allocate(seq, 0, n + 1)
    gen = torch.Generator().manual_seed(9)
    dev = torch.device(DEVICE)
    outs = {}
    for name, backend in (("reference", get_backend("reference")), ("triton", triton_backend())):
        pools = ClassPools(preset, kv.classes, dev)
        results = []
        gen.manual_seed(9)
        for start, end in ((0, n), (n, n + 1)):
            t = end - start
            q = torch.randn(t, 4, 8, generator=gen).to(dev)
            k = torch.randn(t, 2, 8, generator=gen).to(dev)
            v = torch.randn(t, 2, 8, generator=gen).to(dev)
            layout = kv.attention_layout([seq], np.array([end])).on(dev)
            positions = torch.arange(start, end, device=dev)
            cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
            pools.begin(backend, layout, kv.slots(seq, start, end), positions, cu, 4)
            results.append(pools[0].store_attend(backend, q, k, v, 8 ** -0.5))
        outs[name] = results
    for want, got in zip(outs["reference"], outs["triton"], strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@kernel_test
def test_latent_attention_shape():
    """Latent attention's absorbed form: eight query heads over one cached vector of 80
    dims (a 64-dim latent and 16 RoPE dims, not a power of two) read as keys and values
    alike, decodes and a prefill chunk."""
    batch = make_batch([1, 7, 1], [90, 30, 17], block_size=16, group=8, num_kv_heads=1,
                       head_dim=80)
    batch = replace(batch, paged_v=batch.paged_k, cont_v=batch.cont_k)
    check_attention(batch)
