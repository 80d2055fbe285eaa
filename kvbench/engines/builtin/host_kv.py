"""Host memory behind a real engine's cpu offload tier: a buffer of block slots, and the
copies between it and the device pool that the KV manager queued (HostSlots)."""

from __future__ import annotations

from time import perf_counter

import torch
from torch import Tensor

from kvbench.engines.builtin.torch_device import ensure_fits
from kvbench.engines.kv.offload import OffloadTiers


class HostKV:
    """Slots of ``tiers.host`` in host memory (pinned beside a CUDA pool, so the copies are
    direct device-host transfers): every layer's K and V of one block of ``pool`` each."""

    def __init__(self, pool: Tensor, tiers: OffloadTiers) -> None:
        assert tiers.host is not None
        block_tokens = tiers.tiers[0].block_tokens
        layers, kv, _, heads, dim = pool.shape
        shape = (tiers.host.count, layers, kv, block_tokens, heads, dim)
        ensure_fits(pool.dtype.itemsize * shape[0] * layers * kv * block_tokens * heads * dim,
                    torch.device("cpu"), "the host memory of the cpu offload tier")
        self.buffer = torch.zeros(shape, dtype=pool.dtype, pin_memory=pool.is_cuda)
        self.tiers = tiers
        self.block_tokens = block_tokens

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def apply(self, pool: Tensor) -> None:
        """Make the queued copies in order (a slot freed by a load may be stored into next)
        and tell the tiers how long they took."""
        assert self.tiers.host is not None
        moves = self.tiers.host.take_moves()
        if not moves:
            return
        bs, buffer = self.block_tokens, self.buffer
        seconds = [0.0, 0.0]  # loads, stores
        for block, slot, to_host in moves:
            device_block = pool[:, :, block * bs : (block + 1) * bs]
            start = perf_counter()
            # Blocking copies: the step waits for its loads, and a store must finish before
            # the block is written again.
            if to_host:
                buffer[slot].copy_(device_block)
            else:
                device_block.copy_(buffer[slot])
            seconds[to_host] += perf_counter() - start
        self.tiers.measured(store_s=seconds[1], load_s=seconds[0])
