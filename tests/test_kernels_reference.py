"""The torch reference kernels against a dense float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.errors import KvbenchError
from kvbench.kernels import reference, reference_plan
from kvbench.kernels.slot_copy import SlotCopy

HKV, D = 2, 16
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """q [Q, Hq, D] for the last Q of L positions; k/v [L, Hkv, D]; float64, explicit softmax
    over the keys each query sees (its last ``window`` positions, if given)."""
    nq, hq, _ = q.shape
    length, hkv = k.shape[0], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(length - nq, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Case:
    """A ragged batch with per-sequence dense KV placed in a paged and a contiguous cache."""

    def __init__(self, q_lens, ctx_lens, group, block_size, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.q_lens, self.ctx_lens, self.block_size = q_lens, ctx_lens, block_size
        self.hq = HKV * group
        self.scale = D**-0.5
        self.keys = [torch.randn(n, HKV, D, generator=gen).to(dtype) for n in ctx_lens]
        self.values = [torch.randn(n, HKV, D, generator=gen).to(dtype) for n in ctx_lens]
        self.query = torch.randn(sum(q_lens), self.hq, D, generator=gen).to(dtype)
        self.cu = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32)
        self.context_lens = torch.tensor(ctx_lens, dtype=torch.int32)

        # Paged: blocks handed out in shuffled order, tables padded with -1.
        need = [-(-n // block_size) for n in ctx_lens]
        num_blocks = sum(need) + 3
        order = rng.permutation(num_blocks)
        self.block_tables = torch.full((len(ctx_lens), max(need)), -1, dtype=torch.int32)
        self.paged_k = torch.randn(num_blocks * block_size, HKV, D, generator=gen).to(dtype)
        self.paged_v = torch.randn(num_blocks * block_size, HKV, D, generator=gen).to(dtype)
        used = 0
        for b, n in enumerate(ctx_lens):
            blocks = torch.tensor(order[used : used + need[b]], dtype=torch.int32)
            used += need[b]
            self.block_tables[b, : need[b]] = blocks
            pos = torch.arange(n)
            slots = blocks.long()[pos // block_size] * block_size + pos % block_size
            self.paged_k[slots], self.paged_v[slots] = self.keys[b], self.values[b]

        # Contiguous: extents in reverse order with gaps; the last sequence ends the arena.
        starts, cursor = [], 5
        for n in reversed(ctx_lens):
            starts.append(cursor)
            cursor += n + 3
        starts.reverse()
        self.extent_starts = torch.tensor(starts, dtype=torch.int64)
        arena = cursor - 3
        self.cont_k = torch.randn(arena, HKV, D, generator=gen).to(dtype)
        self.cont_v = torch.randn(arena, HKV, D, generator=gen).to(dtype)
        for b, n in enumerate(ctx_lens):
            self.cont_k[starts[b] : starts[b] + n] = self.keys[b]
            self.cont_v[starts[b] : starts[b] + n] = self.values[b]

    def expected(self, window: int | None = None) -> torch.Tensor:
        outs = []
        for b, n in enumerate(self.q_lens):
            q = self.query[int(self.cu[b]) : int(self.cu[b]) + n]
            outs.append(dense_attention(q, self.keys[b], self.values[b], self.scale, window))
        return torch.cat(outs)

    def paged(self, **kw) -> torch.Tensor:
        return reference.paged_attention(
            self.query, self.paged_k, self.paged_v, self.block_tables, self.context_lens,
            self.cu, self.block_size, self.scale, **kw,
        )

    def contiguous(self, **kw) -> torch.Tensor:
        return reference.contiguous_attention(
            self.query, self.cont_k, self.cont_v, self.extent_starts, self.context_lens,
            self.cu, self.scale, **kw,
        )


# Decodes at ragged lengths (partial last blocks), a first prefill chunk, later chunks.
Q_LENS = [1, 1, 7, 1, 20, 5]
CTX_LENS = [1, 33, 7, 64, 50, 17]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_attention_matches_dense(dtype, block_size, group):
    case = Case(Q_LENS, CTX_LENS, group, block_size, dtype)
    want = case.expected()
    for got in (case.paged(), case.contiguous()):
        assert got.dtype == dtype and got.shape == case.query.shape
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("window", [1, 5, 16, 100])
@pytest.mark.parametrize("block_size", [1, 16])
def test_sliding_window_sees_only_the_last_positions(window, block_size):
    case = Case(Q_LENS, CTX_LENS, 4, block_size, torch.float32)
    want = case.expected(window)
    for got in (case.paged(window=window), case.contiguous(window=window)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    if window < max(CTX_LENS):  # a window shorter than the context changes the answer
        assert not torch.allclose(case.paged(window=window).double(), case.expected(),
                                  atol=1e-3)


def test_sliding_window_ignores_whatever_blocks_before_it_hold():
    case = Case([1, 3], [40, 40], 1, 8, torch.float32)
    want = case.paged(window=10)
    case.block_tables[:, :3] = case.block_tables[1, 4]  # positions < 24: another block's KV
    torch.testing.assert_close(case.paged(window=10), want)


def test_a_window_must_be_positive_and_not_over_partial_pools():
    from kvbench.errors import KvbenchError

    case = Case([1], [8], 1, 4, torch.float32)
    with pytest.raises(KvbenchError, match="at least 1"):
        case.paged(window=0)
    positions = torch.zeros(case.paged_k.shape[0], dtype=torch.int32)
    with pytest.raises(KvbenchError, match="not supported"):
        case.paged(window=4, slot_positions=positions,
                   query_positions=torch.zeros(1, dtype=torch.int32))


def test_consecutive_blocks_equal_an_extent_bitwise():
    """A fresh pool's consecutive blocks are read as the contiguous layout reads an extent."""
    case = Case(Q_LENS, CTX_LENS, 4, 16, torch.float32, seed=3)
    need = [-(-n // 16) for n in CTX_LENS]
    first = np.cumsum([0, *need])
    k, v = torch.zeros_like(case.paged_k), torch.zeros_like(case.paged_v)
    for b, n in enumerate(CTX_LENS):
        case.block_tables[b, : need[b]] = torch.arange(first[b], first[b + 1]).int()
        k[first[b] * 16 : first[b] * 16 + n] = case.keys[b]
        v[first[b] * 16 : first[b] * 16 + n] = case.values[b]
    case.paged_k, case.paged_v = k, v
    assert torch.equal(case.paged(), case.contiguous())


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(
        st.integers(1, 40).flatmap(lambda n: st.tuples(st.integers(1, n), st.just(n))),
        min_size=1, max_size=6,
    ),
    block_size=st.sampled_from([1, 3, 16]),
    group=st.sampled_from([1, 2, 4]),
)
def test_attention_ragged_batches(seqs, block_size, group):
    q_lens, ctx_lens = [q for q, _ in seqs], [n for _, n in seqs]
    case = Case(q_lens, ctx_lens, group, block_size, torch.float32)
    want = case.expected()
    torch.testing.assert_close(case.paged().double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(case.contiguous().double(), want, atol=1e-5, rtol=1e-5)


def test_chunked_queries_equal_one_shot():
    """Chunks of one prompt, each attending to all earlier positions, give the rows of one
    full prefill."""
    full = Case([24], [24], 4, 16, torch.float32, seed=5)
    one_shot = full.paged()
    rows = []
    for start, end in [(0, 10), (10, 11), (11, 24)]:
        out = reference.paged_attention(
            full.query[start:end], full.paged_k, full.paged_v, full.block_tables,
            torch.tensor([end], dtype=torch.int32),
            torch.tensor([0, end - start], dtype=torch.int32), 16, full.scale,
        )
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows), one_shot, atol=1e-6, rtol=1e-6)


def test_store_kv_writes_slots():
    k_cache, v_cache = torch.zeros(10, HKV, D), torch.zeros(10, HKV, D)
    key, value = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    slots = torch.tensor([7, 2, 4])
    reference.store_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache[slots], key) and torch.equal(v_cache[slots], value)
    untouched = [i for i in range(10) if i not in (7, 2, 4)]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_store_kv_into_pool_views():
    """The executor's pool is [layers, 2, slots, H, D]; per-layer K/V are views into it."""
    pool = torch.zeros(3, 2, 8, HKV, D)
    key, value = torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    reference.store_kv(pool[1, 0], pool[1, 1], key, value, torch.tensor([5, 0]))
    assert torch.equal(pool[1, 0, 5], key[0]) and torch.equal(pool[1, 1, 0], value[1])
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


def _copy_oracle(data: np.ndarray, copies: list[SlotCopy]) -> np.ndarray:
    out = data.copy()
    for c in copies:
        out[:, c.dst : c.dst + c.num_slots] = out[:, c.src : c.src + c.num_slots].copy()
    return out


@pytest.mark.parametrize(
    "copies",
    [
        [SlotCopy(src=4, dst=1, num_slots=6)],  # compaction slides left over itself
        [SlotCopy(src=1, dst=4, num_slots=6)],  # overlapping slide right
        [SlotCopy(src=0, dst=8, num_slots=3), SlotCopy(src=8, dst=12, num_slots=3)],  # chained
    ],
)
def test_copy_slots_overlapping(copies):
    caches = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)
    want = _copy_oracle(caches.numpy(), copies)
    reference.copy_slots(caches, copies)
    assert np.array_equal(caches.numpy(), want)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(1, 12)).filter(
            lambda t: max(t[0], t[1]) + t[2] <= 32
        ),
        max_size=5,
    )
)
def test_copy_slots_property(raw):
    copies = [SlotCopy(src, dst, n) for src, dst, n in raw]
    caches = torch.randn(4, 32, 2, 3)
    want = _copy_oracle(caches.numpy(), copies)
    reference.copy_slots(caches, copies)
    assert np.array_equal(caches.numpy(), want)


@pytest.mark.parametrize("min_view_blocks", [0, 2, 100])
def test_runs_read_in_place_and_gathered(monkeypatch, min_view_blocks):
    """Tables mixing runs of consecutive blocks and lone blocks: runs at least
    ``min_view_blocks`` long are read in place, the others gathered (all of them at 100,
    none at 0), with prefill chunks whose causal square spans several runs."""
    block_size = 4
    row_bytes = 2 * HKV * D * 4
    monkeypatch.setattr(reference_plan, "MIN_VIEW_BYTES", min_view_blocks * block_size * row_bytes)
    monkeypatch.setattr(reference_plan, "MERGE_COST", 0)
    case = Case([1, 9, 1, 14], [37, 30, 5, 14], 4, block_size, torch.float32, seed=11)
    # Block ids in runs: 0-3, 9, 4-5, 12, 6-8 ... handed out in this order.
    order = [0, 1, 2, 3, 9, 4, 5, 12, 6, 7, 8, 15, 16, 17, 10, 11, 13, 14, 18, 19, 20, 21, 22, 24]
    case.block_tables.fill_(-1)
    k, v = torch.zeros_like(case.paged_k), torch.zeros_like(case.paged_v)
    used = 0
    for b, n in enumerate(case.ctx_lens):
        need = -(-n // block_size)
        blocks = torch.tensor(order[used : used + need])
        used += need
        case.block_tables[b, :need] = blocks.int()
        pos = torch.arange(n)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        k[slots], v[slots] = case.keys[b], case.values[b]
    case.paged_k, case.paged_v = k, v
    torch.testing.assert_close(case.paged().double(), case.expected(), atol=1e-5, rtol=1e-5)


def test_descending_blocks_are_read_as_one_range(monkeypatch):
    """A recycled pool hands blocks out tail first: each sequence's blocks are consecutive
    but descending. Decodes and the part of a chunk before its own tokens read them as one
    slice; results match the oracle."""
    calls = []
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def counting(q, k, *args, **kw):
        calls.append(k.shape[2])
        return real(q, k, *args, **kw)

    monkeypatch.setattr(reference_plan, "MIN_VIEW_BYTES", 0)
    monkeypatch.setattr(reference_plan, "MERGE_COST", 0)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", counting)
    case = Case([1, 8], [30, 40], 4, 4, torch.float32, seed=12)
    k, v = torch.zeros_like(case.paged_k), torch.zeros_like(case.paged_v)
    for b, first in enumerate([8, 20]):  # blocks 7..0 and 19..10
        need = -(-case.ctx_lens[b] // 4)
        blocks = torch.arange(first - 1, first - 1 - need, -1)
        case.block_tables[b, :need] = blocks.int()
        pos = torch.arange(case.ctx_lens[b])
        slots = blocks[pos // 4] * 4 + pos % 4
        k[slots], v[slots] = case.keys[b], case.values[b]
    case.paged_k, case.paged_v = k, v
    torch.testing.assert_close(case.paged().double(), case.expected(), atol=1e-5, rtol=1e-5)
    # The decode: its partial last block (the lowest, slots past the context never read) and
    # one call over the 28 keys of the other blocks; the chunk's 32 earlier keys in one call,
    # its own 8 (descending blocks, kept in order for the causal mask) gathered into another.
    assert calls == [2, 28, 32, 8]


@pytest.mark.parametrize("q_len", [1, 6])
def test_gathered_runs_with_a_partial_block_first(monkeypatch, q_len):
    """Descending blocks gathered whole: sorted by slot, the partial last block comes first
    and is moved to the end so that whole blocks are copied; a chunk's own keys keep their
    order."""
    monkeypatch.setattr(reference_plan, "MIN_VIEW_BYTES", 2**40)
    units = []
    real_gather, real_shared = reference_plan._Planner._gather, reference_plan._Planner._shared

    def spy_gather(self, *args, **kw):
        piece = real_gather(self, *args, **kw)
        units.append(piece.unit)
        return piece

    def spy_shared(self, *args, **kw):  # a decode's runs: the shared gather
        gather, spans = real_shared(self, *args, **kw)
        units.append(gather.unit)
        return gather, spans

    monkeypatch.setattr(reference_plan._Planner, "_gather", spy_gather)
    monkeypatch.setattr(reference_plan._Planner, "_shared", spy_shared)
    case = Case([q_len], [27], 2, 4, torch.float32, seed=13)
    blocks = torch.tensor([9, 7, 5, 3, 1, 8, 6])  # recycled: runs of 1-2 blocks once sorted
    case.block_tables[0, :7] = blocks.int()
    pos = torch.arange(27)
    slots = blocks[pos // 4] * 4 + pos % 4
    case.paged_k[slots], case.paged_v[slots] = case.keys[0], case.values[0]
    torch.testing.assert_close(case.paged().double(), case.expected(), atol=1e-5, rtol=1e-5)
    assert units[0] == 4


def test_sequences_without_keys_give_zero_rows():
    """A pool may hold none of a sequence's keys (context 0): its rows are 0, lse -inf."""
    case = Case([1, 2], [5, 3], 2, 4, torch.float32)
    lens = torch.tensor([0, 3], dtype=torch.int32)
    out, lse = reference.paged_attention(
        case.query[:3], case.paged_k, case.paged_v, case.block_tables, lens,
        torch.tensor([0, 1, 3], dtype=torch.int32), 4, case.scale, return_lse=True,
    )
    assert not out[0].any() and (lse[0] == float("-inf")).all()
    assert torch.isfinite(lse[1:]).all()


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_one_plan_serves_every_layer(layout):
    """A plan made once for a batch gives each layer's call exactly what planning in the call
    gives, for caches of other contents (the layers') but the same shape."""
    case = Case(Q_LENS, CTX_LENS, 4, 16, torch.float32, seed=14)
    if layout == "paged":
        k, v = case.paged_k, case.paged_v
        plan = reference.plan_paged(case.block_tables, case.context_lens, case.cu, 16, k, v,
                                    case.hq)

        def call(k, v, **kw):
            return reference.paged_attention(case.query, k, v, case.block_tables,
                                             case.context_lens, case.cu, 16, case.scale, **kw)
    else:
        k, v = case.cont_k, case.cont_v
        plan = reference.plan_contiguous(case.extent_starts, case.context_lens, case.cu, k, v,
                                         case.hq)

        def call(k, v, **kw):
            return reference.contiguous_attention(case.query, k, v, case.extent_starts,
                                                  case.context_lens, case.cu, case.scale, **kw)
    assert plan.short is not None  # the two short decodes share a call
    for layer in range(3):
        gen = torch.Generator().manual_seed(layer)
        lk, lv = torch.randn(k.shape, generator=gen), torch.randn(v.shape, generator=gen)
        want_o, want_lse = call(lk, lv, return_lse=True)
        got_o, got_lse = call(lk, lv, return_lse=True, plan=plan)
        assert torch.equal(got_o, want_o) and torch.equal(got_lse, want_lse)


def test_a_plan_for_another_batch_is_refused():
    case = Case(Q_LENS, CTX_LENS, 2, 16, torch.float32)
    plan = reference.plan_paged(case.block_tables, case.context_lens, case.cu, 16,
                                case.paged_k, case.paged_v, case.hq)
    with pytest.raises(KvbenchError, match="plan made for"):
        reference.paged_attention(case.query[:-1], case.paged_k, case.paged_v,
                                  case.block_tables, case.context_lens, case.cu, 16, case.scale,
                                  plan=plan)
    with pytest.raises(KvbenchError, match="plan made for"):
        reference.paged_attention(case.query, case.paged_k[:-16], case.paged_v[:-16],
                                  case.block_tables, case.context_lens, case.cu, 16, case.scale,
                                  plan=plan)


def test_short_decodes_are_copied_in_whole_blocks():
    """The padded batch of short decodes copies whole blocks of a paged cache (single slots of
    unaligned extents); its rows match the oracle."""
    lens = [30, 9, 44, 41, 13]
    case = Case([1] * len(lens), lens, 2, 4, torch.float32, seed=15)
    plan = reference.plan_paged(case.block_tables, case.context_lens, case.cu, 4,
                                case.paged_k, case.paged_v, case.hq)
    assert plan.short is not None and plan.short.unit == 4
    assert plan.short.units.shape == (5, 11)
    torch.testing.assert_close(case.paged().double(), case.expected(), atol=1e-5, rtol=1e-5)
    plan = reference.plan_contiguous(case.extent_starts, case.context_lens, case.cu,
                                     case.cont_k, case.cont_v, case.hq)
    assert plan.short is not None and plan.short.unit == 1
    torch.testing.assert_close(case.contiguous().double(), case.expected(), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize(("short_keys", "view_keys"), [(0, 10**6), (12, 10**6), (12, 14)],
                         ids=["gathered", "short-batch", "views"])
def test_carried_plans_equal_fresh_ones(monkeypatch, layout, short_keys, view_keys):
    """Decode steps one key further each, blocks handed out as sequences grow: a plan carried
    on from the step before gives bit for bit what planning afresh gives, through short
    decodes outgrowing their batch and gathered runs growing long enough to be read in
    place; between block boundaries plans are carried, not made."""
    block_size, row_bytes = 16, 2 * HKV * D * 4
    monkeypatch.setattr(reference_plan, "SHORT_DECODE_BYTES", short_keys * row_bytes)
    monkeypatch.setattr(reference_plan, "MIN_VIEW_BYTES", view_keys * row_bytes)
    monkeypatch.setattr(reference_plan, "MERGE_COST", 0)
    gen = torch.Generator().manual_seed(16)
    rng = np.random.default_rng(16)
    ctx = np.array([2, 3, 18, 35, 51])  # close to block boundaries together
    num_slots, hq = 512, HKV * 2
    k, v = (torch.randn(num_slots, HKV, D, generator=gen) for _ in range(2))
    free = list(rng.permutation(num_slots // block_size))
    tables = [[free.pop() for _ in range(-(-int(n) // block_size))] for n in ctx]
    starts = torch.tensor([0, 40, 80, 150, 230])  # extents with room to grow
    cu = torch.arange(len(ctx) + 1, dtype=torch.int32)
    made = []
    real_make = reference_plan.make_plan

    def counting(*args, **kw):
        made.append(1)
        return real_make(*args, **kw)

    monkeypatch.setattr(reference, "make_plan", counting)
    carried = None
    for _ in range(30):
        ctx += 1
        for table, n in zip(tables, ctx, strict=True):
            if len(table) * block_size < n:
                table.append(free.pop())
        lens = torch.tensor(ctx, dtype=torch.int32)
        query = torch.randn(len(ctx), hq, D, generator=gen)
        if layout == "paged":
            width = max(map(len, tables))
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

            def plan(previous, bt=bt, lens=lens):
                return reference.plan_paged(bt, lens, cu, block_size, k, v, hq, previous=previous)

            def attend(p, bt=bt, lens=lens, query=query):
                return reference.paged_attention(query, k, v, bt, lens, cu, block_size, 0.3,
                                                 plan=p, return_lse=True)
        else:
            def plan(previous, lens=lens):
                return reference.plan_contiguous(starts, lens, cu, k, v, hq, previous=previous)

            def attend(p, lens=lens, query=query):
                return reference.contiguous_attention(query, k, v, starts, lens, cu, 0.3,
                                                      plan=p, return_lse=True)
        fresh = plan(None)
        carried = plan(carried)
        (o1, l1), (o2, l2) = attend(fresh), attend(carried)
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert len(made) < 2 * 30 - 15  # most steps carried the plan on
