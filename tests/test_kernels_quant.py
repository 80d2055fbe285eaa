"""Quantised KV pages, key-position masks and merging partial attention, in the torch
reference: against float oracles, with the error bounds of :mod:`kvbench.kernels.quant`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.errors import KvbenchError
from kvbench.kernels import quant, reference, reference_plan
from kvbench.kernels.slot_copy import SlotCopy

HKV, D = 2, 16
QDTYPES = [torch.int8, *([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])]
NEG_INF = float("-inf")


def error_bound(dtype: torch.dtype, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The store's promise for values ``x`` in groups of final scale ``s`` (broadcast)."""
    if dtype == torch.int8:
        return s * (1 + 1e-6)
    return 2**-4 * x.abs() + 2**-9 * s + 1e-7


def dequantised(cache, scale):
    group = cache.shape[0] // scale.shape[0]
    return quant.decode(cache, scale.repeat_interleave(group, 0)[:, :, None])


def dense_attention(q, k, v, scale, q_pos, k_pos):
    """q [Q, Hq, D] at positions q_pos; k/v [L, Hkv, D] at k_pos; float64 softmax, causal by
    position. Rows seeing no key give 0 and lse -inf."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], NEG_INF)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(lse == NEG_INF, 0.0, lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, v), lse.T


class Pool:
    """A paged pool filled through ``store_kv`` the way an engine fills it: sequences get
    shuffled blocks, and tokens arrive in prefill chunks and one-token decodes."""

    def __init__(self, dtype, num_blocks=12, block_size=8, seed=0):
        self.dtype, self.block_size = dtype, block_size
        num_slots = num_blocks * block_size
        if dtype in quant.QMAX:
            self.k = torch.zeros(num_slots, HKV, D).to(dtype)
            self.v = torch.zeros(num_slots, HKV, D).to(dtype)
            self.k_scale = torch.zeros(num_blocks, HKV)
            self.v_scale = torch.zeros(num_blocks, HKV)
        else:
            self.k, self.v = torch.zeros(num_slots, HKV, D), torch.zeros(num_slots, HKV, D)
            self.k_scale = self.v_scale = None
        self.free = np.random.default_rng(seed).permutation(num_blocks).tolist()
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def append(self, seq: int, key: torch.Tensor, value: torch.Tensor) -> None:
        n, bs = key.shape[0], self.block_size
        pos = np.arange(self.lens[seq], self.lens[seq] + n)
        while len(self.tables[seq]) * bs < pos[-1] + 1:
            self.tables[seq].append(self.free.pop())
        slots = torch.tensor([self.tables[seq][p // bs] * bs + p % bs for p in pos])
        reference.store_kv(self.k, self.v, key, value, slots,
                           k_scale=self.k_scale, v_scale=self.v_scale)
        self.lens[seq] += n

    def slots(self, seq: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([self.tables[seq][p // bs] * bs + p % bs
                             for p in range(self.lens[seq])], dtype=torch.long)

    def stored(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention should see: the dequantised (or float) K and V of ``seq``."""
        slots = self.slots(seq)
        if self.k_scale is None:
            return self.k[slots], self.v[slots]
        return (dequantised(self.k, self.k_scale)[slots],
                dequantised(self.v, self.v_scale)[slots])

    def block_tables(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)

    def attention(self, query, cu, **kw):
        return reference.paged_attention(
            query, self.k, self.v, self.block_tables(), torch.tensor(self.lens, dtype=torch.int32),
            cu, self.block_size, D**-0.5, k_scale=self.k_scale, v_scale=self.v_scale, **kw,
        )


def fill(pool: Pool, chunks: list[int], gen: torch.Generator, magnitude=None):
    """One sequence stored in ``chunks``; returns it and its float K and V."""
    seq = pool.add_sequence()
    keys, values = [], []
    for i, n in enumerate(chunks):
        mag = 1.0 if magnitude is None else magnitude[i]
        k, v = mag * torch.randn(n, HKV, D, generator=gen), mag * torch.randn(n, HKV, D,
                                                                                generator=gen)
        pool.append(seq, k, v)
        keys.append(k)
        values.append(v)
    return seq, torch.cat(keys), torch.cat(values)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_fresh_group_fits_its_first_tokens_exactly(dtype):
    pool = Pool(dtype)
    gen = torch.Generator().manual_seed(0)
    seq, k, _ = fill(pool, [3], gen)
    block = pool.tables[seq][0]
    want = k.abs().amax(dim=(0, 2)) / quant.QMAX[dtype]
    torch.testing.assert_close(pool.k_scale[block], want)
    # The largest element of each head gets the largest code.
    codes = pool.k[pool.slots(seq)].float().abs().amax(dim=(0, 2))
    assert torch.equal(codes, torch.full((HKV,), quant.QMAX[dtype]))


@pytest.mark.parametrize("dtype", QDTYPES)
def test_larger_token_raises_scale_by_powers_of_two_and_requantises(dtype):
    pool = Pool(dtype)
    gen = torch.Generator().manual_seed(1)
    k = torch.rand(4, HKV, D, generator=gen) * 2 - 1
    k[0, :, 0], k[2, :, 1], k[3] = 1.0, -5.0, 0.5 * k[3]  # absmax 1, then 5, then below
    seq = pool.add_sequence()
    for t in range(0, 4):
        pool.append(seq, k[t : t + 1], k[t : t + 1])
    block = pool.tables[seq][0]
    ratio = pool.k_scale[block] / (1.0 / quant.QMAX[dtype])
    # 5x larger values need a rise of 8 = 2^3 (a power of two covering them), not 5.
    assert torch.equal(ratio, torch.full((HKV,), 8.0))
    got = dequantised(pool.k, pool.k_scale)[pool.slots(seq)]
    assert ((got - k).abs() <= error_bound(dtype, k, pool.k_scale[block][:, None])).all()
    # The first tokens were requantised: their codes shrank by the rise.
    assert pool.k[pool.slots(seq)[:2]].float().abs().max() == round(quant.QMAX[dtype] / 8)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_writing_a_groups_first_slot_starts_it_afresh(dtype):
    """A block freed after holding large values, then handed to a new sequence."""
    pool = Pool(dtype, num_blocks=1)
    gen = torch.Generator().manual_seed(2)
    fill(pool, [8], gen, magnitude=[100.0])
    pool.free, pool.lens, pool.tables = [0], [], []
    seq, k, _ = fill(pool, [1, 1], gen, magnitude=[1.0, 1.0])
    assert (pool.k_scale[0] < 10.0 / quant.QMAX[dtype]).all()
    got = dequantised(pool.k, pool.k_scale)[pool.slots(seq)]
    assert ((got - k).abs() <= error_bound(dtype, k, pool.k_scale[0][:, None])).all()


@settings(max_examples=30, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    log_mags=st.lists(st.floats(-3, 3), min_size=12, max_size=12),
    dtype=st.sampled_from(QDTYPES),
    block_size=st.sampled_from([1, 4, 8]),
)
def test_store_keeps_every_value_within_its_bound(chunks, log_mags, dtype, block_size):
    """Any order of chunk sizes and magnitudes: each stored value within the documented bound
    of its group's final scale, and that scale within 2x of the tightest."""
    total = sum(chunks)
    pool = Pool(dtype, num_blocks=-(-total // block_size) + 1, block_size=block_size)
    gen = torch.Generator().manual_seed(3)
    seq, k, v = fill(pool, chunks, gen, magnitude=[2.0**m for m in log_mags])
    slots = pool.slots(seq)
    group = slots // block_size
    for cache, scale, x in ((pool.k, pool.k_scale, k), (pool.v, pool.v_scale, v)):
        s = scale[group][:, :, None]
        got = dequantised(cache, scale)[slots]
        assert ((got - x).abs() <= error_bound(dtype, x, s)).all()
        amax = x.abs().amax(-1) / quant.QMAX[dtype]
        tight = torch.zeros_like(scale).scatter_reduce_(
            0, group[:, None].expand_as(amax), amax, "amax"
        )
        used = torch.unique(group)
        assert (scale[used] <= 2 * tight[used] * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", QDTYPES)
def test_prefill_chunk_into_a_partly_filled_block(dtype):
    """One store writing several tokens of one group, none at its first slot."""
    pool = Pool(dtype)
    gen = torch.Generator().manual_seed(4)
    seq, k, v = fill(pool, [3, 9, 1], gen, magnitude=[0.1, 3.0, 1.0])
    got_k, got_v = pool.stored(seq)
    for got, x, scale in ((got_k, k, pool.k_scale), (got_v, v, pool.v_scale)):
        s = scale[pool.slots(seq) // pool.block_size][:, :, None]
        assert ((got - x).abs() <= error_bound(dtype, x, s)).all()


def test_scales_must_match_the_cache():
    cache = torch.zeros(16, HKV, D, dtype=torch.int8)
    x = torch.zeros(1, HKV, D)
    slots = torch.tensor([0])
    with pytest.raises(KvbenchError, match="needs its k_scale"):
        reference.store_kv(cache, cache.clone(), x, x, slots)
    with pytest.raises(KvbenchError, match=r"float32 \[num_slots // group, 2\]"):
        reference.store_kv(cache, cache.clone(), x, x, slots, k_scale=torch.zeros(3, HKV),
                           v_scale=torch.zeros(4, HKV))
    with pytest.raises(KvbenchError, match="scales go with"):
        reference.store_kv(torch.zeros(16, HKV, D), torch.zeros(16, HKV, D), x, x, slots,
                           k_scale=torch.zeros(4, HKV), v_scale=torch.zeros(4, HKV))


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("per", ["block", "slot"])
def test_quantised_attention_matches_dense_over_stored_values(dtype, per):
    """Decodes and prefill chunks over quantised pages equal float64 attention over the
    dequantised values, and stay near attention over the float originals."""
    pool = Pool(dtype, num_blocks=24, block_size=8)
    if per == "slot":
        pool.k_scale = torch.zeros(pool.k.shape[0], HKV)
        pool.v_scale = torch.zeros(pool.v.shape[0], HKV)
    gen = torch.Generator().manual_seed(5)
    seqs = [fill(pool, chunks, gen) for chunks in ([17, 1, 1], [5], [9, 8], [1, 1, 1])]
    q_lens = [1, 5, 8, 1]
    query = torch.randn(sum(q_lens), HKV * 4, D, generator=gen)
    cu = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32)
    got = pool.attention(query, cu)
    for b, (seq, k, v) in enumerate(seqs):
        q = query[int(cu[b]) : int(cu[b + 1])]
        n = pool.lens[seq]
        pos = torch.arange(n)
        want, _ = dense_attention(q, *pool.stored(seq), D**-0.5, pos[n - q.shape[0]:], pos)
        torch.testing.assert_close(got[int(cu[b]) : int(cu[b + 1])].double(), want,
                                   atol=1e-5, rtol=1e-5)
        exact, _ = dense_attention(q, k, v, D**-0.5, pos[n - q.shape[0]:], pos)
        # Unit-normal K/V: int8 steps of ~1/40 and fp8's 6% relative rounding.
        atol = 0.03 if dtype == torch.int8 else 0.15
        torch.testing.assert_close(got[int(cu[b]) : int(cu[b + 1])].double(), exact,
                                   atol=atol, rtol=0)


def test_lse_is_the_log_sum_exp_of_scaled_scores():
    pool = Pool(torch.float32)
    gen = torch.Generator().manual_seed(6)
    seqs = [fill(pool, c, gen) for c in ([20], [3, 1], [7])]
    q_lens = [4, 1, 7]
    query = torch.randn(sum(q_lens), HKV * 2, D, generator=gen)
    cu = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32)
    out, lse = pool.attention(query, cu, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == query.shape[:2]
    for b, (seq, k, v) in enumerate(seqs):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        n, nq = pool.lens[seq], q_lens[b]
        pos = torch.arange(n)
        want_o, want_lse = dense_attention(query[rows], k, v, D**-0.5, pos[n - nq:], pos)
        torch.testing.assert_close(out[rows].double(), want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[rows].double(), want_lse, atol=1e-5, rtol=1e-5)


class TwoPools:
    """One sequence whose text tokens sit in a float pool and image tokens in an int8 pool,
    each pool's slots tagged with the tokens' absolute positions."""

    def __init__(self, length: int, image: range, block_size: int = 4, seed: int = 7):
        gen = torch.Generator().manual_seed(seed)
        self.k = torch.randn(length, HKV, D, generator=gen)
        self.v = torch.randn(length, HKV, D, generator=gen)
        self.pools = {"text": Pool(torch.float32, 12, block_size, seed),
                      "image": Pool(torch.int8, 12, block_size, seed + 1)}
        self.positions = {}
        for name, pool in self.pools.items():
            pos = [p for p in range(length) if (p in image) == (name == "image")]
            seq = pool.add_sequence()
            if pos:
                pool.append(seq, self.k[pos], self.v[pos])
            self.positions[name] = pos
            slot_pos = torch.full((pool.k.shape[0],), -1, dtype=torch.int32)
            slot_pos[pool.slots(seq)] = torch.tensor(pos, dtype=torch.int32)
            pool.slot_positions = slot_pos

    def attend(self, name: str, query, q_pos, **kw):
        pool = self.pools[name]
        cu = torch.tensor([0, query.shape[0]], dtype=torch.int32)
        return pool.attention(query, cu, slot_positions=pool.slot_positions,
                              query_positions=q_pos.to(torch.int32), **kw)

    def union(self):
        """K and V in position order as both pools hold them."""
        k, v = self.k.clone(), self.v.clone()
        for name, pool in self.pools.items():
            if self.positions[name]:
                k[self.positions[name]], v[self.positions[name]] = pool.stored(0)
        return k, v


@pytest.mark.parametrize(
    ("length", "image", "q_pos"),
    [
        (30, range(5, 14), list(range(22, 30))),  # a prefill chunk after the image
        (30, range(5, 14), [29]),  # a decode
        (30, range(5, 14), list(range(0, 12))),  # queries before and inside the image
        (12, range(0, 12), [11]),  # an image-only prefix: the text pool is empty
    ],
)
def test_merged_pools_equal_attention_over_the_union(length, image, q_pos):
    two = TwoPools(length, image)
    gen = torch.Generator().manual_seed(8)
    q_pos = torch.tensor(q_pos)
    query = torch.randn(len(q_pos), HKV * 4, D, generator=gen)
    out_t, lse_t = two.attend("text", query, q_pos, return_lse=True)
    out_i, lse_i = two.attend("image", query, q_pos, return_lse=True)
    out, lse = reference.merge_attention(out_t, lse_t, out_i, lse_i, return_lse=True)
    k, v = two.union()
    want_o, want_lse = dense_attention(query, k, v, D**-0.5, q_pos, torch.arange(length))
    torch.testing.assert_close(out.double(), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    # A query before every image token sees nothing in the image pool.
    before = q_pos < image.start
    assert (lse_i[before] == NEG_INF).all() and not out_i[before].any()


def test_merge_with_an_empty_side_is_the_other_side():
    out = torch.randn(3, 4, D)
    lse = torch.randn(3, 4)
    empty_lse = torch.full((3, 4), NEG_INF)
    merged, merged_lse = reference.merge_attention(
        out, lse, torch.zeros(3, 4, D), empty_lse, return_lse=True
    )
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    both_empty = reference.merge_attention(torch.zeros(3, 4, D), empty_lse,
                                           torch.zeros(3, 4, D), empty_lse)
    assert not both_empty.isnan().any() and not both_empty.any()


def test_positions_must_come_together():
    pool = Pool(torch.float32)
    fill(pool, [3], torch.Generator().manual_seed(0))
    with pytest.raises(KvbenchError, match="go together"):
        pool.attention(torch.zeros(1, HKV, D), torch.tensor([0, 1], dtype=torch.int32),
                       slot_positions=torch.zeros(pool.k.shape[0], dtype=torch.int32))


@pytest.mark.parametrize("dtype", QDTYPES)
def test_copy_slots_moves_scales_with_blocks(dtype):
    """Copy-on-write of a partial block and a compaction slide of whole groups."""
    pool = Pool(dtype, num_blocks=6, block_size=4)
    gen = torch.Generator().manual_seed(9)
    seq, _, _ = fill(pool, [10], gen)
    # The executor's view: [num_caches, S, H, D] data and [num_caches, S // group, H] scales.
    caches = torch.stack([pool.k, pool.v])
    scales = torch.stack([pool.k_scale, pool.v_scale])
    before = torch.stack([dequantised(pool.k, pool.k_scale), dequantised(pool.v, pool.v_scale)])
    src = pool.tables[seq][2] * 4
    dst = pool.free[0] * 4
    copies = [SlotCopy(src=src, dst=dst, num_slots=4), SlotCopy(src=4, dst=0, num_slots=8)]
    reference.copy_slots(caches, copies, scales)
    after = torch.stack([dequantised(caches[i], scales[i]) for i in range(2)])
    want = before.clone()
    for c in copies:
        want[:, c.dst : c.dst + c.num_slots] = want[:, c.src : c.src + c.num_slots].clone()
    assert torch.equal(after, want)
    with pytest.raises(KvbenchError, match="scale-group boundaries"):
        reference.copy_slots(caches, [SlotCopy(src=1, dst=8, num_slots=3)], scales)


@pytest.mark.parametrize("dtype", [torch.float32, *QDTYPES])
@pytest.mark.parametrize("positions", [False, True])
def test_batched_short_decodes_equal_one_by_one(monkeypatch, dtype, positions):
    """Short decodes go through one padded call; one call per sequence gives the same rows,
    with quantised pages and with key positions (a query seeing no key included)."""
    pool = Pool(dtype, num_blocks=16, block_size=4)
    gen = torch.Generator().manual_seed(10)
    for chunks in ([9, 1], [1], [13], [3, 1, 1]):
        fill(pool, chunks, gen)
    query = torch.randn(4, HKV * 4, D, generator=gen)
    cu = torch.arange(5, dtype=torch.int32)
    kw = {}
    if positions:
        slot_pos = torch.full((pool.k.shape[0],), 99, dtype=torch.int32)
        for seq in range(4):
            slot_pos[pool.slots(seq)] = torch.arange(pool.lens[seq], dtype=torch.int32) * 2
        kw = dict(slot_positions=slot_pos,
                  query_positions=torch.tensor([17, -1, 7, 9], dtype=torch.int32))
    batched = pool.attention(query, cu, return_lse=True, **kw)
    monkeypatch.setattr(reference_plan, "SHORT_DECODE_BYTES", 0)
    one_by_one = pool.attention(query, cu, return_lse=True, **kw)
    torch.testing.assert_close(batched[0], one_by_one[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(batched[1], one_by_one[1], atol=1e-6, rtol=1e-6)
    if positions:
        assert (batched[1][1] == NEG_INF).all() and not batched[0][1].any()
    for b in range(4):
        k, v = pool.stored(b)
        n = pool.lens[b]
        k_pos = torch.arange(n) * 2 if positions else torch.arange(n)
        q_pos = kw["query_positions"][b : b + 1] if positions else torch.tensor([n - 1])
        want, _ = dense_attention(query[b : b + 1], k, v, D**-0.5, q_pos, k_pos)
        torch.testing.assert_close(batched[0][b : b + 1].double(), want, atol=1e-5, rtol=1e-5)
