"""What each layer of a model keeps per sequence: its KV, by layer group.

A model is a list of layer groups. Every layer of a group keeps the same kind of state:

- ``full``: K and V of every token, ``kv_heads`` x ``head_dim`` each;
- ``sliding``: the same, for the last ``window`` tokens only;
- ``chunked``: the same, for the tokens of the current ``window``-token chunk only
  (chunked local attention);
- ``latent``: one compressed latent of ``latent_dim`` + ``rope_dim`` elements per token
  (multi-head latent attention), shared by all heads, so every tensor-parallel rank holds
  all of it;
- ``state``: a fixed ``state_bytes`` per sequence, whatever its length (Mamba and
  linear-attention layers), split over tensor-parallel ranks by heads.

Attention groups split their KV heads over tensor-parallel ranks, replicated where there are
fewer heads than ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbench.errors import KvbenchError
from kvbench.units import format_bytes

GroupKind = Literal["full", "sliding", "chunked", "latent", "state"]


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """``layers`` layers keeping the same kind of state (fields unused by a kind stay 0)."""

    kind: GroupKind
    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    window: int = 0  # sliding: the window; chunked: the chunk (tokens)
    latent_dim: int = 0
    rope_dim: int = 0
    state_bytes: int = 0  # per sequence and layer, over all ranks

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise KvbenchError(f"a {self.kind} layer group needs at least one layer")
        if self.kind in ("sliding", "chunked") and self.window < 1:
            raise KvbenchError(f"a {self.kind} layer group needs a window of at least 1 token")
        shape = {"latent": ("latent_dim",), "state": ("state_bytes",)}.get(
            self.kind, ("kv_heads", "head_dim"))
        for name in shape:
            if getattr(self, name) < 1:
                raise KvbenchError(f"a {self.kind} layer group needs {name} of at least 1")

    @property
    def holds_tokens(self) -> bool:
        """Whether the group keeps KV per token (all kinds but ``state``)."""
        return self.kind != "state"

    def elems_per_token(self) -> int:
        """Elements one layer keeps per token, over all ranks."""
        if self.kind == "latent":
            return self.latent_dim + self.rope_dim
        if self.kind == "state":
            return 0
        return 2 * self.kv_heads * self.head_dim

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """KV bytes of one token in every layer of the group, over all ranks."""
        return self.layers * self.elems_per_token() * dtype_bytes

    def bytes_per_token_per_rank(self, dtype_bytes: int, tp: int) -> int:
        """KV bytes of one token that one of ``tp`` ranks holds, over the group's layers."""
        return self.layers * self.layer_bytes_per_token_per_rank(dtype_bytes, tp)

    def layer_bytes_per_token_per_rank(self, dtype_bytes: int, tp: int) -> int:
        """KV bytes of one token in one layer of the group on one of ``tp`` ranks."""
        whole = self.elems_per_token() * dtype_bytes
        if self.kind == "latent":
            return whole  # one latent "head": every rank keeps all of it
        return whole // min(tp, self.kv_heads) if whole else 0

    def tokens_kept(self, context: int) -> int:
        """Token positions one sequence of ``context`` tokens needs at most, the window's or
        chunk's worth for local attention."""
        if self.kind in ("sliding", "chunked"):
            return min(context, self.window)
        return context if self.holds_tokens else 0

    def state_bytes_per_rank(self, tp: int) -> int:
        """Fixed state bytes one sequence keeps in the group on one of ``tp`` ranks."""
        return self.layers * (self.state_bytes // tp)

    def describe(self) -> str:
        """E.g. "sliding 4096 x21", "latent 512+64 x61", "state 1.1 MB x36"."""
        what = {"sliding": f"sliding {self.window}", "chunked": f"chunked {self.window}",
                "latent": f"latent {self.latent_dim}+{self.rope_dim}",
                "state": f"state {format_bytes(self.state_bytes)}"}.get(self.kind, self.kind)
        return f"{what} x{self.layers}"

    def to_json(self) -> dict[str, object]:
        fields = {"kind": self.kind, "layers": self.layers}
        for name in ("kv_heads", "head_dim", "window", "latent_dim", "rope_dim", "state_bytes"):
            value = getattr(self, name)
            if value:
                fields[name] = value
        return fields

