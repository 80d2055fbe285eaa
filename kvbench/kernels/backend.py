"""Kernel backends: the KV-cache kernels the model and executor call, by name.

A backend is a set of functions with the signatures of :mod:`kvbench.kernels.reference`:
``store_kv``, ``paged_attention``, ``contiguous_attention``, ``copy_slots`` and
``merge_attention``, with the same optional quantisation scales, key positions and
log-sum-exp output, and the planners ``plan_paged`` / ``plan_contiguous`` of a backend whose
attention does host-side work worth doing once per step rather than once per layer (None
where it does none).
The torch reference runs anywhere; the Triton backend (:mod:`kvbench.kernels.triton_attention`,
:mod:`kvbench.kernels.triton_kv`) has the same signatures, is checked against the reference,
and is imported only when asked for, so the reference path never needs triton.

What a user must know about the kernels chosen (``auto`` falling back to the reference, a
build cache that cannot be used) is said once per process by
:func:`kvbench.kernels.notices.warn_once`: on stderr, or into a caller's list inside
:func:`collected_warnings` (a run's warnings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from kvbench.errors import KvbenchError
from kvbench.kernels import reference
from kvbench.kernels.notices import COLLECTOR, warn_once

AUTO = "auto"


@contextmanager
def collected_warnings() -> Iterator[list[str]]:
    """The warnings :func:`warn_once` says inside the block, for the caller to report with
    its own (a run's warnings list) rather than printed."""
    said: list[str] = []
    token = COLLECTOR.set(said)
    try:
        yield said
    finally:
        COLLECTOR.reset(token)


@dataclass(frozen=True, slots=True)
class KernelBackend:
    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., Tensor]
    contiguous_attention: Callable[..., Tensor]
    copy_slots: Callable[..., None]
    merge_attention: Callable[..., Tensor | tuple[Tensor, Tensor]]
    plan_paged: Callable[..., Any] | None = None
    plan_contiguous: Callable[..., Any] | None = None


def _reference(device: torch.device | None) -> KernelBackend:
    return KernelBackend(
        name="reference",
        store_kv=reference.store_kv,
        paged_attention=reference.paged_attention,
        contiguous_attention=reference.contiguous_attention,
        copy_slots=reference.copy_slots,
        merge_attention=reference.merge_attention,
        plan_paged=reference.plan_paged,
        plan_contiguous=reference.plan_contiguous,
    )


def _triton(device: torch.device | None) -> KernelBackend:
    if not triton_installed():
        raise KvbenchError(
            "the triton attention backend needs the triton package (CUDA builds of torch "
            "bring it; else pip install triton), or use the reference backend"
        )
    from kvbench.kernels import triton_attention, triton_kv

    if device is not None:
        triton_attention.check_device(device)
    return KernelBackend(
        name="triton",
        store_kv=triton_kv.store_kv,
        paged_attention=triton_attention.paged_attention,
        contiguous_attention=triton_attention.contiguous_attention,
        copy_slots=triton_kv.copy_slots,
        merge_attention=triton_attention.merge_attention,
    )


def _native(device: torch.device | None) -> KernelBackend:
    if device is not None and device.type != "cpu":
        raise KvbenchError(
            f"the native attention backend runs on the CPU, not {device}; use --attention auto")
    from kvbench.kernels import cpu_native

    cpu_native.library()  # built now, so that a missing compiler is refused before a run
    # The reference's KV store, slot copies and merges; the native kernel's decodes.
    return replace(
        _reference(device),
        name="native",
        paged_attention=cpu_native.paged_attention,
        contiguous_attention=cpu_native.contiguous_attention,
        plan_paged=cpu_native.plan_paged,
        plan_contiguous=cpu_native.plan_contiguous,
    )


def _auto_cpu() -> str:
    """``auto``'s backend on the CPU: native where it builds, else the reference (warned)."""
    from kvbench.kernels import cpu_native

    why = cpu_native.unavailable_reason()
    if why is None:
        return "native"
    warn_once(
        f"--attention auto falls back to the torch reference kernel: {why}. Its timings "
        "differ from the native kernel's: fix the C compiler (CC), or pass --attention "
        "reference to choose the reference")
    return "reference"


_BACKENDS: dict[str, Callable[[torch.device | None], KernelBackend]] = {
    "native": _native,
    "reference": _reference,
    "triton": _triton,
}


def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str, device: torch.device | str | None = None) -> KernelBackend:
    """The backend ``name``, checked to run on ``device`` when one is given.

    ``auto`` is triton on CUDA when triton is installed, the native kernel on the CPU when
    it builds here (a C compiler), else the reference; falling back to the reference on the
    CPU is warned about, since it changes the timings.
    """
    dev = torch.device(device) if device is not None else None
    if name == AUTO:
        name = "reference"
        if dev is not None and dev.type == "cuda" and triton_installed():
            name = "triton"
        elif dev is not None and dev.type == "cpu":
            name = _auto_cpu()
    try:
        factory = _BACKENDS[name]
    except KeyError:
        raise KvbenchError(
            f"unknown attention backend {name!r}; valid backends: "
            f"{', '.join([AUTO, *backend_names()])}"
        ) from None
    return factory(dev)
