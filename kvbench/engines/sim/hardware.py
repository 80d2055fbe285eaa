"""Accelerators and their public figures, used by the cost model and capacity planning, and
the device an engine runs on.

Memory is what ``nvidia-smi`` reports as total; bandwidth and dense BF16/FP16 tensor FLOPs
are the vendors' datasheet peaks (no sparsity); ``link_bytes_per_s`` is the per-GPU
interconnect bandwidth for tensor-parallel all-reduce (NVLink, or PCIe for L40S).
``non_torch_bytes`` is the memory per rank that grows outside PyTorch's allocator while an
engine loads and profiles its model (cuBLAS workspaces, attention-backend buffers), which
vLLM's memory profile takes from the KV budget (its logged ``non_torch_memory``); the CUDA
context and NCCL communicators exist before vLLM's start-up snapshot and are not in it.

A device also carries the cost-model coefficients saying how close software gets to those
peaks on it: typical values of well-tuned engines for the table's GPUs, fitted ones for a
device profiled by ``kvbench calibrate``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from kvbench.errors import KvbenchError
from kvbench.units import did_you_mean

MiB = 2**20
GiB = 2**30

# vLLM's profile on an H100-80G, TP 1 (vllm-project/vllm PR #12126, its log: "model weights
# take 19.86GiB; non_torch_memory takes 0.16GiB; PyTorch activation peak memory takes
# 36.63GiB"), measured against torch's reserved bytes since PR #11809. No A100, H200 or L40S
# log found gives a figure, so those take this closest sourced one, as does a saved device
# written before the field existed.
SOURCED_NON_TORCH_BYTES = int(0.16 * GiB)


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """Achieved fractions of the peak figures, and fixed costs the roofline does not see.

    ``overhead_s`` is paid once per step (launches, scheduling, sampling set-up) and
    ``per_seq_s`` per scheduled sequence (batch metadata, per-sequence attention calls):
    GPU engines hide the latter behind the roofline, so it defaults to zero.

    With the ``attention_*`` efficiencies unset, one roofline covers the whole step, as with
    fused attention kernels that run near GEMM efficiency. Set, attention becomes an operator
    with its own roofline (its FLOPs against ``attention_flops_efficiency``, the KV it reads
    and writes against ``attention_bandwidth_efficiency``) added to that of the linear layers
    (their FLOPs, the weights and KV copies): what an unfused attention, as on a CPU, costs.

    ``overlap`` false adds each roofline's compute and memory times instead of taking the
    larger: a device that does not hide one behind the other. Calibration keeps whichever
    form predicts held-out steps best.

    ``map_op_s`` is one virtual-memory map or unmap call of one physical page (one layer's K
    or V on one rank) that a step waits for (``BatchShape.map_ops``; virtually contiguous
    KV). Its default of 10 us is an assumed order of magnitude for a ``cuMemMap`` +
    ``cuMemSetAccess`` pair, not a measurement: calibration does not fit it (no
    virtual-memory probe yet), so set it in a profile for a device where it was measured.
    """

    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    overhead_s: float = 3e-3
    per_seq_s: float = 0.0
    attention_flops_efficiency: float | None = None
    attention_bandwidth_efficiency: float | None = None
    map_op_s: float = 10e-6
    overlap: bool = True

    @property
    def split_attention(self) -> bool:
        return self.attention_flops_efficiency is not None

    def validate(self) -> None:
        if (self.attention_flops_efficiency is None) != (
            self.attention_bandwidth_efficiency is None
        ):
            raise KvbenchError("set both attention efficiencies, or neither")
        if not isinstance(self.overlap, bool):
            raise KvbenchError(
                f"cost coefficient overlap must be true or false, not {self.overlap!r}"
            )
        for name in ("flops_efficiency", "bandwidth_efficiency", "attention_flops_efficiency",
                     "attention_bandwidth_efficiency"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise KvbenchError(
                    f"cost coefficient {name} must be a positive number, not {value}"
                )
        for name in ("overhead_s", "per_seq_s", "map_op_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise KvbenchError(
                    f"cost coefficient {name} must be a non-negative number, not {value}"
                )


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    flops_per_s: float
    link_bytes_per_s: float
    link: str
    coef: CostCoefficients = field(default_factory=CostCoefficients)
    non_torch_bytes: int = SOURCED_NON_TORCH_BYTES

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Hardware:
        """The figures of a saved device, checked: every peak finite and positive."""
        coef = CostCoefficients(**data.get("coef", {}))
        coef.validate()
        hw = cls(**{**data, "coef": coef})
        for name in ("memory_bytes", "hbm_bytes_per_s", "flops_per_s", "link_bytes_per_s"):
            value = getattr(hw, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise KvbenchError(f"{name} must be a positive number, not {value}")
        nt = hw.non_torch_bytes
        if not (isinstance(nt, int) and not isinstance(nt, bool) and nt >= 0):
            raise KvbenchError(f"non_torch_bytes must be a whole number >= 0, not {nt!r}")
        return hw


# non_torch_bytes: h100-sxm is sourced (SOURCED_NON_TORCH_BYTES); the others take that
# figure as the closest sourced one, for want of a log of their own.
_GPUS: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", 40960 * MiB, 1.555e12, 312e12, 600e9, "NVLink3",
                          non_torch_bytes=SOURCED_NON_TORCH_BYTES),
    "a100-80gb": Hardware("a100-80gb", 81920 * MiB, 2.039e12, 312e12, 600e9, "NVLink3",
                          non_torch_bytes=SOURCED_NON_TORCH_BYTES),
    "h100-sxm": Hardware("h100-sxm", 81559 * MiB, 3.35e12, 989e12, 900e9, "NVLink4",
                         non_torch_bytes=SOURCED_NON_TORCH_BYTES),
    "h200": Hardware("h200", 143771 * MiB, 4.8e12, 989e12, 900e9, "NVLink4",
                     non_torch_bytes=SOURCED_NON_TORCH_BYTES),
    "l40s": Hardware("l40s", 46068 * MiB, 0.864e12, 362e12, 64e9, "PCIe4x16",
                     non_torch_bytes=SOURCED_NON_TORCH_BYTES),
}


def gpu_names() -> list[str]:
    return sorted(_GPUS)


def get_gpu(name: str) -> Hardware:
    try:
        return _GPUS[name.lower()]
    except KeyError:
        raise KvbenchError(
            f"unknown GPU {name!r}; {did_you_mean(name.lower(), _GPUS)}valid GPUs: "
            f"{', '.join(gpu_names())}"
        ) from None


# Uncalibrated figures for real compute on a CPU under the virtual clock; replace them with a
# profile from `kvbench calibrate` for predictions that match this machine.
CPU_HARDWARE = Hardware("cpu", psutil.virtual_memory().total, 20e9, 2e11, 20e9, "none",
                        non_torch_bytes=0)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    kind: str  # "cpu" | "cuda" | "sim"
    torch_device: str | None = None
    gpu: Hardware | None = None
    tp: int = 1
    profile: str | None = None  # calibration profile path (sim of a profiled device)
    profiled_kind: str | None = None  # "cpu" | "cuda": what that profile measured

    @property
    def label(self) -> str:
        if self.profile is not None:
            return f"sim:{self.profile}"
        if self.kind == "sim":
            assert self.gpu is not None
            return f"sim:{self.gpu.name}" + (f"x{self.tp}" if self.tp > 1 else "")
        return self.torch_device or self.kind

    @property
    def hardware(self) -> Hardware:
        return self.gpu if self.gpu is not None else CPU_HARDWARE
