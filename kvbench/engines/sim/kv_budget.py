"""The KV cache memory vLLM's GPU worker sizes at start-up, term by term, per rank.

It follows vLLM 0.32.0: ``Worker.determine_available_memory`` (``vllm/v1/worker/gpu_worker.py``)
with ``request_memory`` (``vllm/v1/worker/utils.py``) and ``memory_profiling``
(``vllm/utils/mem_utils.py``)::

    requested = ceil(total memory x gpu_memory_utilization)
    kv = requested - (total_consumed + transient_peak_headroom) - cudagraph_memory_estimate

``total_consumed`` is the drop in free device memory from the worker's start-up snapshot to
the end of the profile run: the weights and the non-torch memory that grew meanwhile (the
CUDA context and NCCL communicators are created before the snapshot, so they sit in the
``1 - gpu_memory_utilization`` share, not in the budget). ``transient_peak_headroom`` is
torch's allocated peak during the profile run above what stays allocated after it: the
activation peak of the profiling forward and its sampler (``gpu_model_runner.profile_run``
with ``_dummy_run`` and ``_dummy_sampler_run``: the batch of :meth:`ForwardShape.profile`).
The CUDA graph estimate (on by default, ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``) counts
only where graphs are captured: an engine run eagerly (``enforce_eager``, as the simulated
engines) has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.sim.activations import ActivationModel, AttentionImpl, ForwardShape


@dataclass(frozen=True, slots=True)
class KVBudget:
    """vLLM's KV cache memory of one rank and what it takes from the requested memory."""

    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    cudagraph_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        """What is left for the KV cache (negative when nothing is)."""
        return (self.requested_bytes - self.weights_bytes - self.activation_peak_bytes
                - self.non_torch_bytes - self.cudagraph_bytes)


def vllm_kv_budget(total_bytes: int, gpu_memory_utilization: float, *, weights_bytes: int,
                   activation_peak_bytes: int, non_torch_bytes: int,
                   cudagraph_bytes: int = 0) -> KVBudget:
    """vLLM 0.32.0's rule from its terms, per rank (``request_memory`` rounds up)."""
    return KVBudget(math.ceil(total_bytes * gpu_memory_utilization), weights_bytes,
                    activation_peak_bytes, non_torch_bytes, cudagraph_bytes)


def profile_activation_bytes(preset: ModelPreset, tp: int, max_num_batched_tokens: int,
                             max_num_seqs: int, attention: AttentionImpl = "fused",
                             page_tokens: int = 1) -> int:
    """The activation peak per rank of vLLM's profiling forward, from the activation model:
    ``max_num_batched_tokens`` tokens over ``max_num_seqs`` fresh prefills, one sampled row
    each (what the simulated device's preallocated engines keep reserved too). The model
    holds the sampled rows' logits and their float32 copy, not the sampler's top-k/top-p
    sort buffers, so where the logits phase is the peak vLLM's measured one is higher."""
    model = ActivationModel(preset, tp, attention, page_tokens)
    return model.peak(ForwardShape.profile(max_num_batched_tokens, max_num_seqs)).total
