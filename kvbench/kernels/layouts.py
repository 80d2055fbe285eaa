"""KV layouts: where each sequence of a batch finds its KV in the pool, and which kernel reads
it. A KV manager describes its layout with one of these (arrays on the host); the executor
moves it to the device with :meth:`on` and makes the step's plan with :meth:`plan` (once for
all layers); the model calls :meth:`attend` with it. A new memory layout is one class here
plus its kernels.

See :mod:`kvbench.kernels.reference` for the tensor shapes and semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from kvbench.kernels.backend import KernelBackend


def _on(array: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    import numpy as np
    import torch

    if isinstance(array, torch.Tensor):
        return array.to(device, dtype)
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype)


class KVLayout(Protocol):
    def on(self, device: torch.device) -> KVLayout:
        """The same layout with its arrays as tensors on ``device``."""
        ...

    def plan(
        self, kernels: KernelBackend, context_lens: Tensor, cu_seqlens_q: Tensor,
        k_cache: Tensor, v_cache: Tensor, num_heads: int, positions: bool = False,
        window: int | None = None, previous: Any = None,
    ) -> Any:
        """The kernels' plan for this layout, lengths and queries over caches shaped like
        ``k_cache``/``v_cache`` (``positions``: calls pass key positions), or None where the
        backend makes none; pass it to :meth:`attend` as ``plan`` in every layer (with the
        same ``window``). ``previous``: the plan of the step before, which the kernels may
        carry on rather than plan afresh."""
        ...

    def attend(
        self, kernels: KernelBackend, query: Tensor, k_cache: Tensor, v_cache: Tensor,
        context_lens: Tensor, cu_seqlens_q: Tensor, scale: float, **options: Any,
    ) -> Any:
        """Varlen attention of ``query`` over each sequence's KV in this layout; ``options``
        go to the kernel (scales of quantised pages, key positions, ``return_lse``,
        ``plan``)."""
        ...


@dataclass(frozen=True, slots=True)
class BlockTables:
    """Paged: ``block_tables`` ``[B, max_blocks]`` int32 of ``block_size``-token blocks."""

    block_tables: Any
    block_size: int

    def on(self, device: torch.device) -> BlockTables:
        import torch

        return BlockTables(_on(self.block_tables, torch.int32, device), self.block_size)

    def plan(
        self, kernels: KernelBackend, context_lens: Tensor, cu_seqlens_q: Tensor,
        k_cache: Tensor, v_cache: Tensor, num_heads: int, positions: bool = False,
        window: int | None = None, previous: Any = None,
    ) -> Any:
        if kernels.plan_paged is None:
            return None
        return kernels.plan_paged(
            self.block_tables, context_lens, cu_seqlens_q, self.block_size, k_cache, v_cache,
            num_heads, positions=positions, window=window, previous=previous,
        )

    def attend(
        self, kernels: KernelBackend, query: Tensor, k_cache: Tensor, v_cache: Tensor,
        context_lens: Tensor, cu_seqlens_q: Tensor, scale: float, **options: Any,
    ) -> Any:
        return kernels.paged_attention(
            query, k_cache, v_cache, self.block_tables, context_lens, cu_seqlens_q,
            self.block_size, scale, **options,
        )


@dataclass(frozen=True, slots=True)
class Extents:
    """Contiguous: ``extent_starts`` ``[B]`` int64, each sequence's first slot."""

    extent_starts: Any

    def on(self, device: torch.device) -> Extents:
        import torch

        return Extents(_on(self.extent_starts, torch.int64, device))

    def plan(
        self, kernels: KernelBackend, context_lens: Tensor, cu_seqlens_q: Tensor,
        k_cache: Tensor, v_cache: Tensor, num_heads: int, positions: bool = False,
        window: int | None = None, previous: Any = None,
    ) -> Any:
        if kernels.plan_contiguous is None:
            return None
        return kernels.plan_contiguous(
            self.extent_starts, context_lens, cu_seqlens_q, k_cache, v_cache, num_heads,
            positions=positions, window=window, previous=previous,
        )

    def attend(
        self, kernels: KernelBackend, query: Tensor, k_cache: Tensor, v_cache: Tensor,
        context_lens: Tensor, cu_seqlens_q: Tensor, scale: float, **options: Any,
    ) -> Any:
        return kernels.contiguous_attention(
            query, k_cache, v_cache, self.extent_starts, context_lens, cu_seqlens_q, scale,
            **options,
        )
