"""Device specs: ``auto | cpu | cuda[:N] | sim:GPU[xTP] | sim:PROFILE.json`` and the KV budget
they give. A profile written by ``kvbench calibrate`` simulates the device it measured."""

from __future__ import annotations

from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.sim.activations import AttentionImpl
from kvbench.engines.sim.hardware import DeviceSpec, Hardware, get_gpu
from kvbench.engines.sim.kv_budget import KVBudget, profile_activation_bytes, vllm_kv_budget
from kvbench.errors import KvbenchError
from kvbench.units import format_bytes


def parse_device(text: str) -> DeviceSpec:
    text = text.strip()
    if text.lower().startswith("sim:") and text.lower().endswith(".json"):
        return _profile_device(text[4:])
    text = text.lower()
    if text == "auto":
        text = "cuda" if _cuda_available() else "cpu"
    if text == "cpu":
        return DeviceSpec("cpu", "cpu")
    if text.startswith("cuda"):
        if not _cuda_available():
            raise KvbenchError(
                f"--device {text}: CUDA is not available here; use --device cpu for real compute "
                "on the CPU, or --device sim:GPU (e.g. sim:h200) to simulate a GPU"
            )
        import torch

        dev = torch.device(text)
        props = torch.cuda.get_device_properties(dev)
        gpu = _match_gpu(props.name, props.total_memory)
        return DeviceSpec("cuda", str(dev), gpu)
    if text.startswith("sim:"):
        name, tp = text[4:], 1
        if "x" in name and name.rsplit("x", 1)[1].isdigit():
            name, tp_text = name.rsplit("x", 1)
            tp = int(tp_text)
            if tp < 1:
                raise KvbenchError(f"--device {text}: tensor-parallel degree must be >= 1")
        return DeviceSpec("sim", None, get_gpu(name), tp)
    raise KvbenchError(
        f"unknown device {text!r}; use auto, cpu, cuda, cuda:N or sim:GPU[xTP] "
        "(e.g. sim:a100-80gbx8), or sim:PROFILE.json from kvbench calibrate"
    )


def _profile_device(path: str) -> DeviceSpec:
    from kvbench.tools.calibrate.profile import load_profile

    profile = load_profile(path)
    return DeviceSpec(
        "sim", None, profile.hardware_spec(), 1, profile=path, profiled_kind=profile.device_kind
    )


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _match_gpu(name: str, memory_bytes: int) -> Hardware:
    """The hardware-table entry of a real CUDA device, by name (for the cost model)."""
    lowered = name.lower().replace(" ", "")
    for key, mem_hint in (("h200", None), ("h100", None), ("l40s", None), ("a100", memory_bytes)):
        if key in lowered:
            if key == "a100":
                return get_gpu("a100-80gb" if (mem_hint or 0) > 50 * 2**30 else "a100-40gb")
            return get_gpu("h100-sxm" if key == "h100" else key)
    return Hardware(name, memory_bytes, 1e12, 1e14, 1e11, "unknown")


def kv_budget_bytes(
    device: DeviceSpec,
    preset: ModelPreset,
    *,
    kv_memory: int | None,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    attention: AttentionImpl = "fused",
    page_tokens: int = 1,
) -> int:
    """Total KV bytes over all ranks: explicit, or vLLM's rule per rank (:func:`gpu_kv_budget`)
    times TP."""
    if kv_memory is not None:
        return kv_memory
    if device.kind == "cpu" or device.profiled_kind == "cpu":
        # The simulated CPU keeps the real one's budget, so a replay matches a real run.
        return 256 * 2**20
    budget = gpu_kv_budget(
        device, preset, gpu_memory_utilization=gpu_memory_utilization,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        attention=attention, page_tokens=page_tokens,
    )
    if budget.kv_bytes <= 0:
        raise KvbenchError(
            f"{preset.name} leaves no KV memory on {device.label}: of "
            f"{format_bytes(budget.requested_bytes)} per rank (gpu_memory_utilization "
            f"{gpu_memory_utilization}), weights take {format_bytes(budget.weights_bytes)}, the "
            f"profiled activation peak {format_bytes(budget.activation_peak_bytes)} and non-torch "
            f"memory {format_bytes(budget.non_torch_bytes)}: use more tensor parallelism (e.g. "
            f"sim:{device.hardware.name}x{device.tp * 2}), a larger GPU, a smaller model, or "
            "lower max_num_batched_tokens"
        )
    return budget.kv_bytes * device.tp


def gpu_kv_budget(
    device: DeviceSpec,
    preset: ModelPreset,
    *,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    attention: AttentionImpl = "fused",
    page_tokens: int = 1,
) -> KVBudget:
    """vLLM's KV budget of one rank of a GPU device (:mod:`kvbench.engines.sim.kv_budget`): the
    device's memory x utilisation, less the rank's weights, the activation model's peak on
    vLLM's profiling batch and the device's non-torch memory. The simulated engines run
    eagerly, so no CUDA graph memory is taken. A real CUDA device starts from its free
    memory, as memory other processes hold is not this run's."""
    if device.kind == "cuda":
        import torch

        memory, _total = torch.cuda.mem_get_info(device.torch_device)
    else:
        memory = device.hardware.memory_bytes
    tp = device.tp
    return vllm_kv_budget(
        memory, gpu_memory_utilization,
        weights_bytes=preset.weight_bytes // tp,
        activation_peak_bytes=profile_activation_bytes(
            preset, tp, max_num_batched_tokens, max_num_seqs, attention, page_tokens),
        non_torch_bytes=device.hardware.non_torch_bytes,
    )


def on_demand_kv_bytes(device: DeviceSpec, preset: ModelPreset) -> int:
    """The KV budget of a simulated on-demand cache: all the device memory besides the
    weights (per rank, times TP), as a dynamic cache reserves nothing and grows until the
    device is full; its memory model says when it no longer fits."""
    per_rank = device.hardware.memory_bytes - preset.weight_bytes // device.tp
    if per_rank <= 0:
        raise KvbenchError(
            f"{preset.name} weights ({preset.weight_bytes / 2**30:.1f} GiB) do not fit "
            f"{device.label}: use more tensor parallelism or a larger GPU"
        )
    return per_rank * device.tp
