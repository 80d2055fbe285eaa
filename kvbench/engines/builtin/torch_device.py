"""Choosing a torch device and allocating on it with errors that say what to do."""

from __future__ import annotations

import math

import psutil
import torch

from kvbench.errors import KvbenchError
from kvbench.units import format_bytes

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA must be present."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise KvbenchError(
            f"unknown device {name!r}; use cpu, cuda or cuda:N (or a sim:<gpu> engine device)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KvbenchError(
            f"device {name!r} asked for but this torch build sees no CUDA device; "
            "use --device cpu for real compute here, or --device sim:<gpu> to simulate one"
        )
    if device.type not in ("cpu", "cuda"):
        raise KvbenchError(f"device {name!r} is not supported; use cpu or cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation can use now: free device memory, or available host memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, what: str
) -> torch.Tensor:
    """``torch.zeros`` that fails with a KvbenchError naming ``what``, the bytes and free memory.

    Zeroing touches every page, so host memory is really committed (and counted in RSS)
    rather than overcommitted; the CPU check comes first because the kernel would rather
    kill the process than fail the allocation.
    """
    nbytes = dtype.itemsize * math.prod(shape)
    if device.type == "cpu":
        ensure_fits(nbytes, device, what)
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except torch.cuda.OutOfMemoryError:
        raise _oom(what, nbytes, free_bytes(device), device) from None


def ensure_fits(nbytes: int, device: torch.device, what: str) -> None:
    """Fail early, with the figures, when ``nbytes`` more cannot fit on ``device``."""
    free = free_bytes(device)
    if nbytes > free:
        raise _oom(what, nbytes, free, device)


def _oom(what: str, nbytes: int, free: int, device: torch.device) -> KvbenchError:
    return KvbenchError(
        f"cannot allocate {what}: {format_bytes(nbytes)} ({nbytes} bytes) asked, "
        f"{format_bytes(free)} ({free} bytes) free on {device}; lower the KV budget, pick a "
        "smaller model preset or use another device"
    )
