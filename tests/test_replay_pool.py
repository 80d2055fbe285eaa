"""The event replay's C block pool behaves as the paged manager's block pool (LRU): the same
block ids handed out, the same lookups, release results, counters, eviction order and
evicted keys, after every operation of random sequences of the calls the replay makes."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.hashing import BlockHasher
from kvbench.engines.sim.replay import pool as replay_pool
from kvbench.engines.sim.replay.pool import ListPool, NativePool
from kvbench.workloads.model import contents_token_ids, key_hash

# The C pool where a compiler builds it, LRU and LFU, and the pool the replay takes where
# none does (BlockPool fed numpy keys).
_NEEDS_CC = pytest.mark.skipif(replay_pool._library() is None, reason="no C compiler")
POOLS = [(ListPool, "lru"), (ListPool, "lfu"), pytest.param(NativePool, "lru", marks=_NEEDS_CC),
         pytest.param(NativePool, "lfu", marks=_NEEDS_CC)]


def _pools(pool: type, eviction: str, num_blocks: int) -> tuple[BlockPool, object]:
    """``BlockPool`` and the replay's ``pool`` of ``num_blocks``, both evicting by
    ``eviction``."""
    if pool is NativePool:
        return BlockPool(num_blocks, BS, eviction), NativePool(num_blocks, BS, eviction == "lfu")
    return BlockPool(num_blocks, BS, eviction), pool(num_blocks, BS, eviction)

BS = 4


def _keys(keys: list[int]) -> np.ndarray:
    return np.asarray(keys, dtype=np.uint64)


def _counters(pool: BlockPool | NativePool) -> tuple[int, ...]:
    return (pool.num_free, pool.num_plain_free, pool.num_shared, pool.num_allocs,
            pool.num_frees, pool.num_evictions, pool.num_lost)


@pytest.mark.parametrize(("pool", "eviction"), POOLS)
@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(4, 24), data=st.data())
def test_replay_pool_matches_block_pool(pool: type, eviction: str, num_blocks: int,
                                        data: st.DataObject) -> None:
    ref, arr = _pools(pool, eviction, num_blocks)
    # Live tables: blocks, keys cached per block (None: not yet), slots filled.
    tables: list[tuple[list[int], list[int | None], int]] = []
    # Keys from a small range, so that duplicates across tables and hits happen; within a
    # table keys differ (they chain every token before them).
    key = st.integers(0, 12)
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["admit", "cache", "release", "rekey", "grow"]))
        if op == "admit":
            # A sequence looks up a prefix, hits what it can, and takes fresh blocks.
            keys = data.draw(st.lists(key, max_size=5, unique=True))
            hits = ref.lookup(keys)
            assert list(arr.lookup(_keys(keys))) == hits
            fresh = data.draw(st.integers(0, 4))
            if fresh + ref.count_free(hits) > ref.num_free:
                assert fresh + arr.count_free(hits) > arr.num_free
                continue
            assert arr.count_free(hits) == ref.count_free(hits)
            assert arr.touch(hits) == ref.touch(hits)
            got = _take(ref, arr, fresh)
            blocks = hits + got
            cached: list[int | None] = [keys[i] for i in range(len(hits))]
            tables.append((blocks, cached + [None] * fresh, len(hits) * BS))
        elif op == "grow" and tables and ref.num_free:
            i = data.draw(st.integers(0, len(tables) - 1))
            blocks, cached, filled = tables[i]
            got = _take(ref, arr, 1)
            tables[i] = (blocks + got, [*cached, None], filled)
        elif op == "cache" and tables:
            # Fill the next uncached blocks of a table with KV and cache them: content keys
            # or placeholders (a block's id, negated).
            i = data.draw(st.integers(0, len(tables) - 1))
            blocks, cached, filled = tables[i]
            todo = [j for j, c in enumerate(cached) if c is None]
            if not todo:
                continue
            take = todo[: data.draw(st.integers(1, len(todo)))]
            used = {c for c in cached if c is not None}
            keys = []
            for j in take:
                k = data.draw(key) if data.draw(st.booleans()) else ~blocks[j]
                keys.append(~blocks[j] if k in used else k)
                used.add(keys[-1])
            sel = [blocks[j] for j in take]
            known = [(b, k) for b, k in zip(sel, keys, strict=True) if k >= 0]
            ref.cache([b for b, _ in known], [k for _, k in known], 0, len(known))
            arr.cache([b for b, _ in known], [k for _, k in known], 0, len(known))
            held = [b for b, k in zip(sel, keys, strict=True) if k < 0]
            ref.cache_placeholders(held)
            arr.cache_placeholders(held)
            for j, k in zip(take, keys, strict=True):
                cached[j] = k
            tables[i] = (blocks, cached, max(filled, (take[-1] + 1) * BS))
        elif op == "rekey" and tables:
            i = data.draw(st.integers(0, len(tables) - 1))
            blocks, cached, filled = tables[i]
            held = [j for j, c in enumerate(cached) if c is not None and c < 0]
            if not held:
                continue
            used = {c for c in cached if c is not None and c >= 0}
            unused = [k for k in range(13) if k not in used]
            if len(unused) < len(held):
                continue
            new = data.draw(st.lists(st.sampled_from(unused), min_size=len(held),
                                     max_size=len(held), unique=True))
            sel = [blocks[j] for j in held]
            ref.rekey(sel, new)
            arr.rekey(sel, _keys(new))
            for j, k in zip(held, new, strict=True):
                cached[j] = k
        elif op == "release" and tables:
            i = data.draw(st.integers(0, len(tables) - 1))
            blocks, _, filled = tables.pop(i)
            filled = min(filled + data.draw(st.integers(0, BS - 1)), len(blocks) * BS)
            assert arr.count_alone(blocks) == ref.count_alone(blocks)
            if data.draw(st.integers(0, 5)):
                assert arr.release(blocks, filled) == ref.release(blocks, filled)
            else:  # the leak fault: they lose their keys and never go free again
                assert arr.leak(blocks, filled) == ref.leak(blocks, filled)
        assert _counters(arr) == _counters(ref)
        probe = data.draw(st.lists(key, max_size=4))
        assert list(arr.lookup(_keys(probe))) == ref.lookup(probe)
    # Everything handed back: the same blocks come out in the same order.
    for blocks, _, filled in tables:
        assert arr.release(blocks, filled) == ref.release(blocks, filled)
    assert _take(ref, arr, ref.num_free) or not ref.num_free
    assert _counters(arr) == _counters(ref)


def _take(ref: BlockPool, arr: ListPool | NativePool, n: int) -> list[int]:
    """``n`` blocks from both pools: the same blocks, the same keys and hits evicted."""
    ref_keys, arr_keys, ref_hits, arr_hits = array("Q"), array("Q"), array("q"), array("q")
    got = ref.take(n, ref_keys, ref_hits)
    assert list(arr.take(n, arr_keys, arr_hits)) == got
    assert arr_keys == ref_keys and arr_hits == ref_hits
    return got


@pytest.mark.parametrize(("pool", "eviction"), POOLS)
def test_the_free_queue_wraps_around(pool: type, eviction: str) -> None:
    """Blocks cached and freed one at a time, hundreds of times over, some taken back by a
    hit (holes) and some evicted: the free queue outgrows its array and is compacted, with
    the same eviction order as BlockPool's."""
    num_blocks = 5
    ref, arr = _pools(pool, eviction, num_blocks)
    rng = np.random.default_rng(0)
    for i in range(600):
        key = int(rng.integers(0, 40))
        hits = ref.lookup([key])
        assert list(arr.lookup(_keys([key]))) == hits
        assert arr.touch(hits) == ref.touch(hits)
        fresh = ref.take(2)
        assert list(arr.take(2)) == fresh
        new = [key] if not hits else []
        ref.cache(fresh[: len(new)], new, 0, len(new))
        arr.cache(fresh[: len(new)], new, 0, len(new))
        table = hits + fresh
        filled = len(table) * BS - int(rng.integers(0, BS))
        assert arr.release(table, filled) == ref.release(table, filled), i
        assert _counters(arr) == _counters(ref), i
    assert list(arr.take(num_blocks)) == ref.take(num_blocks)


@pytest.mark.skipif(replay_pool._library() is None, reason="no C compiler")
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("vocab_size", [2, 32000, 151936])
def test_contents_digests_in_c_are_numpys(block_size: int, vocab_size: int) -> None:
    """The prompt digests the C pass makes are those of the numpy passes, bit for bit."""
    rng = np.random.default_rng(block_size * vocab_size)
    keys = [f"segment-{i}" for i in range(20)]
    counts = (rng.integers(0, 40, len(keys)) * block_size).tolist()
    hasher = BlockHasher(block_size)
    contents = np.array([key_hash(k) for k in keys], dtype=np.uint64)
    got = replay_pool.contents_digests(contents, counts, vocab_size, hasher)
    want = hasher.digests(contents_token_ids(contents, counts, vocab_size))
    assert got.dtype == np.uint64 and np.array_equal(got, want)


@pytest.mark.skipif(replay_pool._library() is None, reason="no C compiler")
def test_the_c_pool_refuses_ids_outside_it_and_takes_beyond_its_free_blocks() -> None:
    """The C pool reads block ids through raw pointers: one outside the pool, or a take of
    more blocks than are free, is refused before anything changes."""
    pool = NativePool(4, BS)
    table = pool.take(2)
    before = _counters(pool)
    for call in (lambda: pool.touch([4]), lambda: pool.release([0, -1], 4),
                 lambda: pool.count_free([7]), lambda: pool.cache_placeholders([4]),
                 lambda: pool.cache([9], [1], 0, 1), lambda: pool.rekey([4], _keys([1]))):
        with pytest.raises(IndexError):
            call()
    with pytest.raises(RuntimeError, match="take"):
        pool.take(3)
    assert _counters(pool) == before
    assert pool.release(table, 2 * BS) == 2 * BS
    assert list(pool.take(4)) == [0, 1, 2, 3]
