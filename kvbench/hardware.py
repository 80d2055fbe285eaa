"""Accelerators and their public figures, used by the cost model and capacity planning.

Memory is what ``nvidia-smi`` reports as total; bandwidth and dense BF16/FP16 tensor FLOPs
are the vendors' datasheet peaks (no sparsity); ``link_bytes_per_s`` is the per-GPU
interconnect bandwidth for tensor-parallel all-reduce (NVLink, or PCIe for L40S).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvbench.errors import KvbenchError

MiB = 2**20


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    flops_per_s: float
    link_bytes_per_s: float
    link: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_GPUS: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", 40960 * MiB, 1.555e12, 312e12, 600e9, "NVLink3"),
    "a100-80gb": Hardware("a100-80gb", 81920 * MiB, 2.039e12, 312e12, 600e9, "NVLink3"),
    "h100-sxm": Hardware("h100-sxm", 81559 * MiB, 3.35e12, 989e12, 900e9, "NVLink4"),
    "h200": Hardware("h200", 143771 * MiB, 4.8e12, 989e12, 900e9, "NVLink4"),
    "l40s": Hardware("l40s", 46068 * MiB, 0.864e12, 362e12, 64e9, "PCIe4x16"),
}


def gpu_names() -> list[str]:
    return sorted(_GPUS)


def get_gpu(name: str) -> Hardware:
    try:
        return _GPUS[name.lower()]
    except KeyError:
        raise KvbenchError(f"unknown GPU {name!r}; valid GPUs: {', '.join(gpu_names())}") from None
