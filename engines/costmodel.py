"""Roofline cost model: predicted step time from the batch shape, model shape and device.

step = overhead + max(FLOPs / (peak FLOPs x flops_eff), bytes / (HBM bw x bw_eff))
       + tensor-parallel all-reduce time

FLOPs: 2 x params x tokens for the layer matmuls, LM head for sampled positions only, and
4 x heads x head_dim x (query, key) pairs per layer for attention. Bytes: weights once per
step, KV read for every context position, KV written for every new token, plus copies.
All per tensor-parallel rank. The efficiencies and overhead are the coefficients
``kvbench calibrate`` fits; the defaults are typical of well-tuned engines, not measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvbench.engines.base import BatchShape
from kvbench.engines.presets import ModelPreset

from kvbench.hardware import Hardware

# Per all-reduce launch latency on NVLink-class links (NCCL small-message latency).
_ALLREDUCE_LATENCY_S = 10e-6


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    overhead_s: float = 3e-3


@dataclass(frozen=True, slots=True)
class CostModel:
    preset: ModelPreset
    hardware: Hardware
    tp: int = 1
    coef: CostCoefficients = CostCoefficients()

    def step_time_s(self, batch: BatchShape) -> float:
        if batch.num_tokens == 0 and batch.copied_bytes == 0:
            return 0.0
        p, tp = self.preset, self.tp
        tokens = batch.num_tokens
        flops = (
            2 * p.num_layers * p.layer_params * tokens
            + 2 * p.vocab_size * p.hidden_size * batch.num_seqs
            + 4 * p.num_layers * p.num_heads * p.head_dim * batch.attn_pairs
        ) / tp
        kv_rank = p.kv_bytes_per_token_per_rank(tp)
        nbytes = (
            p.weight_bytes / tp
            + (batch.context_tokens + tokens) * kv_rank
            + batch.copied_bytes / tp
        )
        t = self.coef.overhead_s + max(
            flops / (self.hardware.flops_per_s * self.coef.flops_efficiency),
            nbytes / (self.hardware.hbm_bytes_per_s * self.coef.bandwidth_efficiency),
        )
        if tp > 1:
            # Two ring all-reduces of the hidden states per layer (attention out, MLP out).
            msg = tokens * p.hidden_size * p.dtype_bytes
            ring = 2 * (tp - 1) / tp * msg / self.hardware.link_bytes_per_s
            t += 2 * p.num_layers * (ring + _ALLREDUCE_LATENCY_S)
        return t

    def describe(self) -> dict[str, Any]:
        return {"hardware": self.hardware.to_json(), "tp": self.tp, **asdict(self.coef)}
