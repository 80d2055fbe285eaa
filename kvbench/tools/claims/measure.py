"""Measurements on this machine's CPU that several studies share: memory-copy bandwidth and
decode attention through the torch reference kernels, paged (shuffled blocks) or
contiguous, timed with ``time.perf_counter`` (medians of repeats)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second read + written copying a 256 MiB tensor into another."""
    import torch

    src = torch.ones(64 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)  # written once first, so no page faults are timed
    return 2 * src.numel() * 4 / median_time(lambda: dst.copy_(src), repeats)


def decode_attention_s(block_size: int | None, repeats: int, *, seqs: int = 16,
                       context: int = 1024, kv_heads: int = 8, group: int = 4,
                       head_dim: int = 128) -> float:
    """One decode step's attention over ``seqs`` x ``context`` cached tokens: through
    ``block_size``-token blocks in shuffled order, or (None) contiguous extents."""
    import torch

    from kvbench.kernels import reference

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seqs, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(seqs * context, kv_heads, head_dim, generator=gen)
    v = torch.randn(seqs * context, kv_heads, head_dim, generator=gen)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    cu = torch.arange(seqs + 1, dtype=torch.int32)
    scale = head_dim ** -0.5
    if block_size is None:
        starts = torch.arange(seqs, dtype=torch.int64) * context
        return median_time(
            lambda: reference.contiguous_attention(q, k, v, starts, lens, cu, scale), repeats)
    if context % block_size:
        raise ValueError(f"context {context} is not a multiple of block size {block_size}")
    order = torch.randperm(seqs * context // block_size, generator=gen)
    tables = order.view(seqs, -1).to(torch.int32)
    return median_time(
        lambda: reference.paged_attention(q, k, v, tables, lens, cu, block_size, scale),
        repeats)
