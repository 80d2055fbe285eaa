"""How an allocation policy lays a model's layer groups out in pages, and the bytes one
request then takes: what the policy allocates against what its tokens and state need.

- ``uniform``: one pool in which every attention layer keeps every token (vLLM with its
  hybrid KV cache manager disabled treats sliding-window layers as full attention). A
  model with recurrent state has no such layout.
- ``common-page``: vLLM's hybrid allocator (as of vLLM 0.32). Layers of each kind are cut
  into groups of ``G`` layers, ``G`` the fewest layers of any kind (the most, where that is
  under 1.5 times the fewest), the last group of a kind padded with empty layer slots; one
  block takes one page in each of a group's ``G`` tensors, and every page has the same
  bytes: attention blocks grow, in multiples of the block size, until their page holds a
  recurrent layer's state, whose page is padded up to the attention page.
- ``per-group``: a pool per group with its own page size, under one budget (Jenga's
  per-layer-type pools): attention pages of ``block_size`` tokens, state of its own bytes.

Sliding-window groups hold the blocks that cover their window while decoding (a prefill
chunk briefly holds more); a state group holds one page per sequence (no prefix caching of
state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from kvbench.engines.model.layers import LayerGroup
from kvbench.engines.model.presets import ModelPreset
from kvbench.errors import KvbenchError

GroupPolicy = Literal["uniform", "common-page", "per-group"]
GROUP_POLICIES: tuple[GroupPolicy, ...] = ("uniform", "common-page", "per-group")


@dataclass(frozen=True, slots=True)
class GroupPages:
    """One group's pages on one rank: ``tensors`` layer tensors (``layers`` real ones, the
    rest padding), pages of ``page_tokens`` tokens (0: a page holds one sequence's state)
    and ``page_bytes`` bytes in each tensor."""

    group: LayerGroup
    tensors: int
    page_tokens: int
    page_bytes: int

    def pages(self, context: int) -> int:
        """Pages one sequence of ``context`` tokens holds at most."""
        g = self.group
        if not g.holds_tokens:
            return 1
        if g.kind in ("sliding", "chunked") and context > g.window:
            # The window's tokens can straddle one more block boundary than they fill.
            return min(math.ceil(context / self.page_tokens),
                       math.ceil((g.window - 1) / self.page_tokens) + 1)
        return math.ceil(context / self.page_tokens)

    def request_bytes(self, context: int) -> int:
        return self.pages(context) * self.page_bytes * self.tensors


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """``policy``'s pages; ``layers_per_group`` is common-page's group size (each of its
    groups takes one block per page position), 0 where every group is one pool's."""

    policy: GroupPolicy
    block_size: int
    groups: tuple[GroupPages, ...]
    layers_per_group: int = 0

    @property
    def label(self) -> str:
        return f"{self.policy}/bs{self.block_size}"

    def request_bytes(self, context: int) -> int:
        """Bytes one request of ``context`` tokens takes on one rank at most."""
        return sum(g.request_bytes(context) for g in self.groups)

    @property
    def padding_tensors(self) -> int:
        return sum(g.tensors - g.group.layers for g in self.groups)


def group_layout(preset: ModelPreset, policy: GroupPolicy, block_size: int,
                 tp: int) -> GroupLayout:
    """``policy``'s pages for ``preset`` on one of ``tp`` ranks, attention blocks of
    ``block_size`` tokens (common-page enlarges them to hold a state page)."""
    if block_size < 1:
        raise KvbenchError(f"block size must be at least 1 token, got {block_size}")
    groups = preset.layer_groups
    b = preset.dtype_bytes
    if policy == "uniform":
        if any(not g.holds_tokens for g in groups):
            raise KvbenchError(f"{preset.name} keeps recurrent state: no layout holds it as "
                               "per-token KV in every layer; use common-page or per-group")
        return GroupLayout(policy, block_size, tuple(
            _own_pages(replace(g, kind="full", window=0) if g.kind in ("sliding", "chunked")
                       else g, g.layers, block_size, b, tp) for g in groups))
    if policy == "per-group":
        return GroupLayout(policy, block_size, tuple(
            _own_pages(g, g.layers, block_size, b, tp) for g in groups))
    if policy == "common-page":
        return _common_page(preset, block_size, tp)
    raise KvbenchError(f"unknown group allocation policy {policy!r}; choose one of "
                       f"{', '.join(GROUP_POLICIES)}")


def _own_pages(g: LayerGroup, tensors: int, block_size: int, dtype_bytes: int,
               tp: int) -> GroupPages:
    if not g.holds_tokens:
        return GroupPages(g, tensors, 0, g.state_bytes // tp)
    per_token = g.layer_bytes_per_token_per_rank(dtype_bytes, tp)
    return GroupPages(g, tensors, block_size, block_size * per_token)


def _common_page(preset: ModelPreset, block_size: int, tp: int) -> GroupLayout:
    groups, b = preset.layer_groups, preset.dtype_bytes
    fewest, most = min(g.layers for g in groups), max(g.layers for g in groups)
    size = most if most < 1.5 * fewest else fewest
    tensors = {id(g): math.ceil(g.layers / size) * size for g in groups}
    state = max((g.state_bytes // tp for g in groups if not g.holds_tokens), default=0)
    attention = [g for g in groups if g.holds_tokens]
    token_bytes = {id(g): g.layer_bytes_per_token_per_rank(b, tp) for g in attention}
    # The largest attention page at block_size sets the page; a state page may raise it.
    page = max((block_size * t for t in token_bytes.values()), default=state)
    if state > page:
        smallest = min(token_bytes.values())
        page = math.ceil(state / (block_size * smallest)) * block_size * smallest
    out = []
    for g in groups:
        if not g.holds_tokens:
            out.append(GroupPages(g, tensors[id(g)], 0, page))
            continue
        if page % token_bytes[id(g)]:
            raise KvbenchError(f"{preset.name}: its attention groups' pages cannot be made "
                               "one size")
        out.append(GroupPages(g, tensors[id(g)], page // token_bytes[id(g)], page))
    return GroupLayout("common-page", max(p.page_tokens for p in out), tuple(out), size)
