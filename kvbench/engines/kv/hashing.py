"""Chained hashes of full KV blocks, the keys of the prefix cache.

Block ``i`` of a sequence hashes to ``h_i = h_{i-1} * P + digest(block i's token ids)`` (mod
2**64, ``h_{-1} = ROOT_HASH``), so ``h_i`` names the whole prefix up to and including block
``i``: two sequences share a cached block only if every token before it matches too. The
digest is a dot product of the block's ids with fixed odd weights plus a constant, scrambled by
splitmix64; the constant keeps a block of token 0 from digesting to 0 (splitmix64 fixes 0),
which with a zero chain value would make ``[zeros, X]`` and ``[X]`` collide.

Because the chain is linear in the digests it vectorises: with ``Q = P**-1``,
``h_i = P**i * (h_{-1} * P + sum_{j<=i} d_j * Q**j)``, one cumulative sum. A 15k-token prompt
hashes in a few numpy passes instead of a Python loop per block; a single block (decode) takes a
short pure-Python path that computes the same values, since numpy's per-call overhead would
dominate there.
"""

from __future__ import annotations

from operator import mul

import numpy as np

_MASK = (1 << 64) - 1
_P = 0x100000001B3  # odd, hence invertible mod 2**64
_Q = pow(_P, -1, 1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15
ROOT_HASH = _GOLDEN
# Below this many blocks the pure-Python path beats numpy's fixed per-call cost.
_NUMPY_MIN_BLOCKS = 4


def _splitmix_int(x: int) -> int:
    x ^= x >> 30
    x = (x * _MIX1) & _MASK
    x ^= x >> 27
    x = (x * _MIX2) & _MASK
    return x ^ (x >> 31)


def _splitmix_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x *= np.uint64(_MIX1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_MIX2)
    return x ^ (x >> np.uint64(31))


class BlockHasher:
    """Computes chained block hashes for one block size."""

    __slots__ = ("_p_pows", "_q_pows", "_weights_list", "block_size", "weights")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._weights_list = [
            _splitmix_int((k + 1) * _GOLDEN & _MASK) | 1 for k in range(block_size)
        ]
        self.weights = np.array(self._weights_list, dtype=np.uint64)
        self._p_pows = np.ones(1, dtype=np.uint64)
        self._q_pows = np.ones(1, dtype=np.uint64)

    def chain(self, parent: int, token_ids: np.ndarray | list[int]) -> list[int]:
        """Hashes of the consecutive full blocks in ``token_ids`` that follow a block hashed
        ``parent`` (``ROOT_HASH`` at the start of a sequence). A partial tail is ignored."""
        bs = self.block_size
        n = len(token_ids) // bs
        if n < _NUMPY_MIN_BLOCKS:
            head = token_ids[: n * bs]
            return self._chain_py(parent, head if isinstance(head, list) else head.tolist())
        blocks = np.ascontiguousarray(token_ids[: n * bs], dtype=np.uint64).reshape(n, bs)
        digests = _splitmix_np(blocks @ self.weights + np.uint64(_GOLDEN))
        p_pows, q_pows = self._powers(n)
        # uint64 arithmetic wraps, which is exactly mod 2**64.
        sums = np.cumsum(digests * q_pows) + np.uint64(parent * _P & _MASK)
        return (p_pows * sums).tolist()

    def digests(self, ids: np.ndarray) -> np.ndarray:
        """Each full block's digest (``ids`` a multiple of the block size long)."""
        blocks = np.ascontiguousarray(ids, dtype=np.uint64).reshape(-1, self.block_size)
        return _splitmix_np(blocks @ self.weights + np.uint64(_GOLDEN))

    def chain_each(self, digests: np.ndarray, blocks: np.ndarray) -> list[np.ndarray]:
        """``chain(ROOT_HASH, ...)`` of many sequences in one pass, from their blocks'
        :meth:`digests`, one sequence's (``blocks[i]`` of them) after another's. Each
        sequence's sum restarts where it starts: a cumulative sum over all of them, less its
        value before the sequence."""
        total = int(blocks.sum())
        if not total:
            return [np.zeros(0, dtype=np.uint64) for _ in range(len(blocks))]
        first = np.cumsum(blocks) - blocks
        local = np.arange(total, dtype=np.int64) - np.repeat(first, blocks)
        p_pows, q_pows = self._powers(int(blocks.max()))
        sums = np.cumsum(digests * q_pows[local])
        before = np.concatenate((np.zeros(1, dtype=np.uint64), sums))[np.repeat(first, blocks)]
        # uint64 arithmetic wraps, which is exactly mod 2**64.
        hashes = p_pows[local] * (sums - before + np.uint64(ROOT_HASH * _P & _MASK))
        return np.split(hashes, np.cumsum(blocks)[:-1])

    def _chain_py(self, parent: int, ids: list[int]) -> list[int]:
        bs, weights = self.block_size, self._weights_list
        out = []
        h = parent
        for start in range(0, len(ids), bs):
            dot = sum(map(mul, ids[start : start + bs], weights))
            digest = _splitmix_int((dot + _GOLDEN) & _MASK)
            h = (h * _P + digest) & _MASK
            out.append(h)
        return out

    def _powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self._p_pows) < n:
            size = max(n, 2 * len(self._p_pows))
            self._p_pows = _pow_table(_P, size)
            self._q_pows = _pow_table(_Q, size)
        return self._p_pows[:n], self._q_pows[:n]


def _pow_table(base: int, n: int) -> np.ndarray:
    """``base**i mod 2**64`` for ``i < n``."""
    out = np.ones(n, dtype=np.uint64)
    out[1:] = np.cumprod(np.full(n - 1, base, dtype=np.uint64))
    return out
