"""Quantised KV pages: storage formats, where the scales live, and how a store keeps them valid.

Formats. A quantised cache stores codes: ``int8`` (symmetric, codes in [-127, 127]) or
``float8_e4m3fn`` (finite, |code| <= 448). A stored value is ``code x scale``.

Scales. ``k_scale`` and ``v_scale`` are float32 ``[S // group, num_kv_heads]``: one scale per
*scale group* of ``group`` consecutive slots and KV head, for K and for V apart. ``group`` is
read from the shapes (``S // k_scale.shape[0]``). A paged cache uses its block size (one scale
per block per KV head) or a divisor of it. A contiguous arena either starts every extent at a
group boundary or uses ``group = 1`` (one scale per token and head, never requantised).

Store rule. Decode appends one token at a time, so a group's scale must stay valid as its
tokens arrive:

- A group's slots are written in order, by one owner at a time: a block is filled from
  offset 0 after every allocation and appended to after that (true of paged blocks, copied
  ones included; contiguous extents must start on group boundaries). So a store that
  writes a group's first slot starts it afresh (scale 0), and the group's valid codes are
  those before the store's first slot in it.
- When new tokens' absmax exceeds the group's range (``scale x qmax``), the scale rises to
  ``old x 2^k``, the smallest power-of-two multiple that covers them (or exactly absmax /
  qmax on a fresh group), and the group's codes written so far are requantised: real work,
  done by the store, once per rise. A power-of-two ratio keeps requantisation exact for fp8
  (an exponent shift) and bounds int8 drift: fitting the scale exactly would let a code
  that rounds back to itself ride many small rises, its value growing with the scale.

Error bounds (``s`` = the group's final scale, ``x`` a stored value):

- int8: ``|x - x_hat| <= s / 2`` with no rise, ``<= s`` after any number of rises (each adds at
  most half a step of a scale at least twice the one before); ``s < 2 absmax / 127``.
- fp8 e4m3: ``|x - x_hat| <= 2^-4 |x| + 2^-9 s`` (half an ulp of a 3-bit mantissa, plus the
  subnormal floor that a rise can push small codes into).

Copies. Scale groups move with their slots: a slot copy of a quantised cache must start on a
group boundary at both ends and moves ``ceil(num_slots / group)`` scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvbench.errors import KvbenchError
from kvbench.kernels.slot_copy import SlotCopy

# The largest code of each storage dtype.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0}
if hasattr(torch, "float8_e4m3fn"):
    QMAX[torch.float8_e4m3fn] = 448.0
    # Every float8 e4m3 code's value, by its bits.
    _FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def is_quantised(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def scale_group(cache: Tensor, scale: Tensor | None, name: str = "scale") -> int:
    """Slots per scale group of ``cache`` ``[S, Hkv, D]`` with ``scale`` ``[S // group, Hkv]``;
    checks that the two agree with each other and with the cache's dtype."""
    quantised = is_quantised(cache.dtype)
    if scale is None:
        if quantised:
            raise KvbenchError(f"a {cache.dtype} KV cache needs its {name} tensor")
        return 0
    if not quantised:
        raise KvbenchError(
            f"{name} given for a {cache.dtype} KV cache; scales go with "
            f"{', '.join(map(str, QMAX))} caches"
        )
    num_slots, num_heads = cache.shape[0], cache.shape[1]
    if (
        scale.dtype != torch.float32
        or scale.dim() != 2
        or scale.shape[1] != num_heads
        or scale.shape[0] == 0
        or num_slots % scale.shape[0]
    ):
        raise KvbenchError(
            f"{name} must be float32 [num_slots // group, {num_heads}] for a cache of "
            f"{num_slots} slots; got {scale.dtype} {list(scale.shape)}"
        )
    return num_slots // scale.shape[0]


def to_codes(y: Tensor, dtype: torch.dtype) -> Tensor:
    """float32 ``y`` (in code units) rounded and clamped to ``dtype``'s codes."""
    qmax = QMAX[dtype]
    if dtype == torch.int8:
        # Round half up, the rule the Triton store uses too.
        return torch.floor(y + 0.5).clamp_(-qmax, qmax).to(dtype)
    return y.clamp(-qmax, qmax).to(dtype)


def encode(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Codes of float32 ``x`` at ``scale`` (broadcast); a zero scale gives code 0."""
    return to_codes(torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0), dtype)


def decode(codes: Tensor, scale: Tensor) -> Tensor:
    """float32 values of ``codes`` at ``scale`` (broadcast)."""
    if codes.device.type != "cpu":
        return codes.float() * scale
    # torch's CPU casts from int8 and float8 are scalar loops; numpy's int8 cast is SIMD and
    # a 256-entry table serves float8: 4-8x faster on the reference's hot path.
    raw = codes.numpy() if codes.dtype == torch.int8 else _FP8_VALUES[codes.view(torch.uint8)
                                                                      .numpy()]
    values = torch.from_numpy(raw.astype(np.float32, copy=False))
    return values.mul_(scale)


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """One store's scale updates, per token in slot order (``order`` indexes the store's
    tokens). ``leader`` marks the first token of each scale group in this store; ``old`` and
    ``new`` are that group's scales ``[T, Hkv]`` before and after (0 before when the store
    starts the group afresh); ``requantise`` marks leaders whose group holds codes (the
    slots before the leader's) that the rise must rescale by ``ratio`` = old / new, a power
    of two."""

    order: Tensor
    slots: Tensor
    groups: Tensor
    leader: Tensor
    old: Tensor
    new: Tensor
    ratio: Tensor
    requantise: Tensor


def plan_scales(
    scale: Tensor, x: Tensor, slot_mapping: Tensor, group: int, dtype: torch.dtype
) -> ScalePlan:
    """The scale update for storing ``x`` ``[T, Hkv, D]`` at ``slot_mapping`` (distinct slots).

    Torch ops only, with no read-back to the host, so the Triton store uses it on the device.
    """
    slots, order = torch.sort(slot_mapping)
    groups = torch.div(slots, group, rounding_mode="floor")
    num_tokens = slots.shape[0]
    leader = torch.ones(num_tokens, dtype=torch.bool, device=slots.device)
    leader[1:] = groups[1:] != groups[:-1]
    rows = torch.arange(num_tokens, device=slots.device)
    # Each token's leader: the last leader at or before it, in slot order.
    lead = torch.where(leader, rows, 0).cummax(0).values
    amax = x[order].abs().amax(-1).float() / QMAX[dtype]
    need = torch.zeros_like(amax).scatter_reduce_(
        0, lead[:, None].expand_as(amax), amax, "amax"
    )[lead]
    # A group's smallest written slot is its leader's: the group restarts if it is the first.
    fresh = (slots % group == 0)[:, None]
    old = torch.where(fresh, 0.0, scale[groups])[lead]
    rise = need > old
    steps = torch.ceil(torch.log2(need / torch.where(old > 0, old, 1.0)))
    new = torch.where(rise, torch.where(old > 0, old * torch.exp2(steps), need), old)
    # log2 may round a ratio just above a power of two down onto it.
    new = torch.where(new < need, new * 2, new)
    ratio = torch.where(new > 0, old / torch.where(new > 0, new, 1.0), 1.0)
    requantise = leader & ((old > 0) & rise).any(-1)
    return ScalePlan(order, slots, groups, leader, old, new, ratio, requantise)


def copy_group(caches: Tensor, scales: Tensor) -> int:
    """Slots per scale group of ``caches`` ``[num_caches, S, ...]`` with ``scales``
    ``[num_caches, S // group, ...]``."""
    if scales.shape[0] != caches.shape[0] or caches.shape[1] % scales.shape[1]:
        raise KvbenchError(
            f"scales {list(scales.shape)} do not match caches {list(caches.shape)}: need "
            "[num_caches, num_slots // group, ...]"
        )
    return caches.shape[1] // scales.shape[1]


def check_aligned(copy: SlotCopy, group: int) -> None:
    if copy.src % group or copy.dst % group:
        raise KvbenchError(
            f"slot copy {copy.src} -> {copy.dst} of a quantised cache must start on "
            f"scale-group boundaries (every {group} slots)"
        )
