"""The C key queues of offload tiers hold, evict and find the same keys in the same order
as the Python eviction queues they stand in for (LRU, and by rank as LFU), through random
operations that grow their tables, compact and grow the LRU ring and rebuild the heap."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbench.engines.kv import key_queue

pytestmark = pytest.mark.skipif(key_queue._library() is None, reason="no C compiler here")


@pytest.mark.parametrize("lru", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_the_c_queues_match_the_python_ones(seed: int, lru: bool) -> None:
    rng = random.Random(seed)
    c, py = key_queue.key_queue(lru), key_queue.PyKeyQueue(lru)
    assert isinstance(c, key_queue.KeyQueue if lru else key_queue.RankedQueue)
    # Keys from a small space (so that they come back) and from the top of the range.
    space = [rng.getrandbits(64) for _ in range(3000)] + [(1 << 64) - 1 - i for i in range(50)]
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            keys = rng.sample(space, rng.randrange(1, 60))
            given = np.array(keys, dtype=np.uint64) if rng.random() < 0.5 else keys
            if lru:
                c.add_many(given)
                py.add_many(keys)
            else:  # few ranks, so that ties fall to the order added
                ranks = [rng.choice([0, 1, 2, 0.5, 3.25]) for _ in keys]
                c.add_ranked(given, ranks)
                py.add_ranked(keys, ranks)
        elif op < 0.55 and len(py):
            held = list(py)
            keys = rng.sample(held, rng.randrange(1, min(len(held), 20) + 1))
            c.remove_many(keys)
            py.remove_many(keys)
        elif op < 0.7:
            keys = rng.sample(space, 30)
            assert c.discard(keys) == py.discard(keys)
        elif op < 0.85 and len(py):
            n = rng.randrange(1, len(py) + 1)
            assert list(c.evict(n)) == py.evict(n)
        else:
            held = list(py)
            keys = held[: rng.randrange(len(held) + 1)] + rng.sample(space, 3)
            start = rng.randrange(len(keys))
            assert c.run(keys, start) == py.run(keys, start)
        assert len(c) == len(py)
    assert (list(c) == list(py)) if lru else (sorted(c) == sorted(py))
    assert all(k in c for k in py)
    assert (space[0] in c) == (space[0] in py)


def test_evicting_more_than_it_holds_is_refused() -> None:
    q = key_queue.KeyQueue()
    q.add_many([1, 2, 3])
    with pytest.raises(RuntimeError, match="evict"):
        q.evict(4)
    assert list(q.evict(3)) == [1, 2, 3] and len(q) == 0

