"""The C key queue of LRU offload tiers holds, evicts and finds the same keys in the same
order as the Python eviction queue it stands in for, through random operations that grow
its table and compact and grow its ring."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbench.engines.kv import key_queue
from kvbench.engines.kv.eviction import LRUQueue

pytestmark = pytest.mark.skipif(key_queue._library() is None, reason="no C compiler here")


@pytest.mark.parametrize("seed", range(4))
def test_the_c_queue_matches_the_python_one(seed: int) -> None:
    rng = random.Random(seed)
    c, py = key_queue.KeyQueue(), key_queue.PyKeyQueue(LRUQueue())
    # Keys from a small space (so that they come back) and from the top of the range.
    space = [rng.getrandbits(64) for _ in range(3000)] + [(1 << 64) - 1 - i for i in range(50)]
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            keys = rng.sample(space, rng.randrange(1, 60))
            as_array = rng.random() < 0.5
            c.add_many(np.array(keys, dtype=np.uint64) if as_array else keys)
            py.add_many(keys)
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
    assert list(c) == list(py)
    assert all(k in c for k in py)
    assert (space[0] in c) == (space[0] in py)


def test_evicting_more_than_it_holds_is_refused() -> None:
    q = key_queue.KeyQueue()
    q.add_many([1, 2, 3])
    with pytest.raises(RuntimeError, match="evict"):
        q.evict(4)
    assert list(q.evict(3)) == [1, 2, 3] and len(q) == 0
