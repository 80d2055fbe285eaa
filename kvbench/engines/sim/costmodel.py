"""Roofline cost model: predicted step time from the batch shape, model shape and device.

step = overhead + per_seq x seqs
       + max(FLOPs / (peak FLOPs x flops_eff), bytes / (HBM bw x bw_eff))
       + tensor-parallel all-reduce time

or, where compute and memory traffic do not overlap (``CostCoefficients.overlap`` false),
their sum in place of each max; and where attention runs as its own, unfused operator
(``CostCoefficients.split_attention``), the max is taken separately for the linear layers
(their FLOPs; weights and copies) and for attention (its FLOPs; the KV it reads and writes),
and the two are added. Unfused attention
also computes the masked half of each prefill chunk's query x key square; the batch shape
does not keep chunk sizes, so that is estimated as if the step's prefill chunks were equal.

FLOPs: 2 x params x tokens for the layer matmuls (active experts only for MoE), LM head for
sampled positions only, and 4 x heads x head_dim x (query, key) pairs per layer for attention
(latent attention: absorbed for decoding queries, 2 x heads x (2 x latent + RoPE dims), and
decompressed for prefill, 2 x heads x (query-key + value head dims)). Bytes: weights
once per step, KV read for every context position, KV written for every new token, each
sequence's recurrent state read and written, plus copies.
Virtual-memory map/unmap calls the step waits for (``BatchShape.map_ops``) add
``map_op_s`` each; every rank maps its own pages in parallel with the others. Loads of KV
from offload tiers (``BatchShape.load_s``, priced by their link) are added before the step,
or overlap it layer by layer.

All per tensor-parallel rank: each rank holds 1/TP of the weights and of the KV heads
(replicated when there are fewer KV heads than ranks) and does 1/TP of the FLOPs; two ring
all-reduces of the hidden states per layer join the ranks. The coefficients come with the
device (``Hardware.coef``): defaults typical of well-tuned engines for the GPU table, fitted
ones from ``kvbench calibrate`` for a profiled device.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kvbench.engines.base import BatchShape
from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.sim.hardware import CostCoefficients, Hardware

__all__ = ["CostCoefficients", "CostModel", "RooflineTerms"]

# Per all-reduce launch latency on NVLink-class links (NCCL small-message latency).
_ALLREDUCE_LATENCY_S = 10e-6


@dataclass(frozen=True, slots=True)
class RooflineTerms:
    """A step's work on one rank, before any coefficient is applied."""

    flops: float
    attention_flops: float  # of which attention's (causal query x key pairs)
    masked_attention_flops: float  # what unfused attention adds for masked pairs
    nbytes: float
    kv_bytes: float  # of which KV read and written
    allreduce_s: float  # tensor-parallel all-reduces (0 on one rank)


@dataclass(frozen=True, slots=True)
class CostModel:
    """``coef`` overrides the device's own coefficients; left out, it is ``hardware.coef``."""

    preset: ModelPreset
    hardware: Hardware
    tp: int = 1
    coef: CostCoefficients | None = None
    # Per-rank constants of the model shape, fixed at construction: the virtual clock asks
    # for every step's time, and the preset's shape properties are not free to recompute.
    _flops_per_token: int = field(init=False, repr=False, compare=False, default=0)
    _flops_per_seq: int = field(init=False, repr=False, compare=False, default=0)
    _flops_per_pair: int = field(init=False, repr=False, compare=False, default=0)
    _flops_per_decode_pair: int = field(init=False, repr=False, compare=False, default=0)
    _weight_bytes: float = field(init=False, repr=False, compare=False, default=0.0)
    _kv_bytes_per_token: int = field(init=False, repr=False, compare=False, default=0)
    _state_bytes_per_seq: int = field(init=False, repr=False, compare=False, default=0)
    # Sliding-window layers beside whole-context ones (ModelPreset.split_window): their
    # pairs and KV reads come from the batch's window_* counts; 0 for any other model.
    _window_flops_per_pair: int = field(init=False, repr=False, compare=False, default=0)
    _window_flops_per_decode_pair: int = field(init=False, repr=False, compare=False,
                                               default=0)
    _window_kv_bytes_per_token: int = field(init=False, repr=False, compare=False, default=0)
    _allreduce_bytes_per_token: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        p, tp = self.preset, self.tp
        for name, value in (
            ("coef", self.hardware.coef if self.coef is None else self.coef),
            ("_flops_per_token", 2 * p.active_layer_params),
            ("_flops_per_seq", 2 * p.vocab_size * p.hidden_size),
            ("_flops_per_pair", p.attention_flops_per_pair()),
            ("_flops_per_decode_pair", p.attention_flops_per_pair(decode=True)),
            ("_weight_bytes", p.weight_bytes / tp),
            ("_kv_bytes_per_token", p.kv_bytes_per_token_per_rank(tp)),
            # Recurrent state: read and written back once a step by each sequence.
            ("_state_bytes_per_seq", 2 * p.kv_bytes_per_rank(0, tp)),
            ("_allreduce_bytes_per_token", p.hidden_size * p.dtype_bytes),
        ):
            object.__setattr__(self, name, value)
        if p.split_window is not None:
            b = p.dtype_bytes
            for name, value in (
                ("_flops_per_pair", p.attention_flops_per_pair(windowed=False)),
                ("_flops_per_decode_pair", p.attention_flops_per_pair(True, windowed=False)),
                ("_window_flops_per_pair", p.attention_flops_per_pair(windowed=True)),
                ("_window_flops_per_decode_pair", p.attention_flops_per_pair(True, True)),
                ("_kv_bytes_per_token", sum(g.bytes_per_token_per_rank(b, tp)
                                            for g in p.windowed_groups(False))),
                ("_window_kv_bytes_per_token", sum(g.bytes_per_token_per_rank(b, tp)
                                                   for g in p.windowed_groups(True))),
            ):
                object.__setattr__(self, name, value)

    def terms(self, batch: BatchShape) -> RooflineTerms:
        return RooflineTerms(*self._work(batch))

    def _work(self, batch: BatchShape) -> tuple[float, float, float, float, float, float]:
        """The fields of :class:`RooflineTerms`, as a plain tuple."""
        tp = self.tp
        tokens = batch.prefill_tokens + batch.decode_tokens
        decode_pairs = batch.decode_pairs
        attention = (self._flops_per_pair * (batch.attn_pairs - decode_pairs)
                     + self._flops_per_decode_pair * decode_pairs)
        kv_bytes = ((batch.context_tokens + tokens) * self._kv_bytes_per_token
                    + batch.num_seqs * self._state_bytes_per_seq)
        pair_flops = self._flops_per_pair
        if self._window_kv_bytes_per_token:
            window_decode = batch.window_decode_pairs
            attention += (self._window_flops_per_pair * (batch.window_pairs - window_decode)
                          + self._window_flops_per_decode_pair * window_decode)
            kv_bytes += (batch.window_context_tokens + tokens) * self._window_kv_bytes_per_token
            pair_flops += self._window_flops_per_pair
        flops = (
            self._flops_per_token * tokens + self._flops_per_seq * batch.num_seqs + attention
        ) / tp
        nbytes = self._weight_bytes + kv_bytes + batch.copied_bytes / tp
        # Decodes are the sequences with one token each; the rest share the prefill tokens.
        prefills = batch.num_seqs - batch.decode_tokens
        masked_pairs = 0.0
        if prefills > 0:
            chunk = batch.prefill_tokens / prefills
            masked_pairs = prefills * chunk * (chunk - 1) / 2
        allreduce = 0.0
        if tp > 1:
            # Two ring all-reduces of the hidden states per layer (attention out, MLP out).
            msg = tokens * self._allreduce_bytes_per_token
            ring = 2 * (tp - 1) / tp * msg / self.hardware.link_bytes_per_s
            allreduce = 2 * self.preset.num_layers * (ring + _ALLREDUCE_LATENCY_S)
        masked = pair_flops * masked_pairs / tp
        return flops, attention / tp, masked, nbytes, kv_bytes, allreduce

    def step_time_s(self, batch: BatchShape) -> float:
        c = self.coef
        assert c is not None  # resolved at construction
        if batch.prefill_tokens + batch.decode_tokens == 0 and batch.copied_bytes == 0:
            # No forward pass; only the mapping calls, if any, take time.
            return c.map_op_s * batch.map_ops / self.tp
        flops, attention, masked, nbytes, kv_bytes, allreduce = self._work(batch)
        roofline = self._roofline(flops, attention, masked, nbytes, kv_bytes,
                                  max if c.overlap else operator.add)
        step = c.overhead_s + c.per_seq_s * batch.num_seqs + roofline + allreduce
        if batch.map_ops:
            step += c.map_op_s * batch.map_ops / self.tp
        if batch.load_s:
            step = self._with_loads(step, batch)
        return step

    def load_stall_s(self, batch: BatchShape) -> float:
        """Seconds ``batch``'s step waits on its loads from offload tiers: its time with them
        less its time without."""
        if not batch.load_s:
            return 0.0
        return self.step_time_s(batch) - self.step_time_s(replace(batch, load_s=0.0))

    def _with_loads(self, step: float, batch: BatchShape) -> float:
        """``step`` with its loads from offload tiers: waited for before it starts, or, layer
        by layer, overlapping the compute of the layers already loaded (the first layer's
        share still comes first)."""
        if not batch.load_layerwise:
            return step + batch.load_s
        return max(step, batch.load_s) + batch.load_s / self.preset.num_layers

    def decode_step_times(self, num_seqs: int | np.ndarray, context: np.ndarray,
                          pairs: np.ndarray) -> np.ndarray | None:
        """``step_time_s`` of consecutive steps that each decode one token of ``num_seqs``
        sequences (the same at every step, or one count per step), reading ``context[j]``
        KV positions in ``pairs[j]`` query x key pairs at step ``j``: the same
        floating-point operations in the same order, on arrays, so every time equals the
        one-step figure bit for bit. None when an integer term would exceed 2**53 (it would
        round differently as a float)."""
        c = self.coef
        assert c is not None
        if self._window_kv_bytes_per_token:
            return None  # a jump's steps carry no window counts: price them one by one
        tp, n = self.tp, num_seqs
        context = np.asarray(context, dtype=np.int64)
        pairs = np.asarray(pairs, dtype=np.int64)
        limit = 1 << 53
        attention_i = self._flops_per_decode_pair * pairs
        flops_i = self._flops_per_token * n + self._flops_per_seq * n + attention_i
        kv_i = (context + n) * self._kv_bytes_per_token + n * self._state_bytes_per_seq
        if max(int(flops_i.max(initial=0)), int(kv_i.max(initial=0))) >= limit:
            return None
        flops = flops_i.astype(np.float64) / tp
        attention = attention_i.astype(np.float64) / tp
        masked = self._flops_per_pair * 0.0 / tp  # every sequence decodes: no prefill chunk
        kv_bytes = kv_i.astype(np.float64)
        nbytes = self._weight_bytes + kv_bytes + 0 / tp
        allreduce = 0.0
        if tp > 1:
            msg = n * self._allreduce_bytes_per_token
            ring = 2 * (tp - 1) / tp * msg / self.hardware.link_bytes_per_s
            allreduce = 2 * self.preset.num_layers * (ring + _ALLREDUCE_LATENCY_S)
        roofline = self._roofline(flops, attention, masked, nbytes, kv_bytes,
                                  np.maximum if c.overlap else np.add)
        return c.overhead_s + c.per_seq_s * n + roofline + allreduce

    def _roofline(self, flops: Any, attention: Any, masked: Any, nbytes: Any, kv_bytes: Any,
                  combine: Callable[[Any, Any], Any]) -> Any:
        """The step's compute and memory time, each side at its efficiency, joined by
        ``combine``: ``max`` where they overlap (a roofline), a sum where they do not. Takes
        floats or arrays alike, so that a fast-forwarded step equals a single one bit for bit."""
        c, hw = self.coef, self.hardware
        assert c is not None
        peak_flops, peak_bw = hw.flops_per_s, hw.hbm_bytes_per_s
        if not c.split_attention:
            return combine(flops / (peak_flops * c.flops_efficiency),
                           nbytes / (peak_bw * c.bandwidth_efficiency))
        assert c.attention_flops_efficiency and c.attention_bandwidth_efficiency
        return combine(
            (flops - attention) / (peak_flops * c.flops_efficiency),
            (nbytes - kv_bytes) / (peak_bw * c.bandwidth_efficiency),
        ) + combine(
            (attention + masked) / (peak_flops * c.attention_flops_efficiency),
            kv_bytes / (peak_bw * c.attention_bandwidth_efficiency),
        )

    def describe(self) -> dict[str, Any]:
        assert self.coef is not None
        return {"hardware": self.hardware.to_json(), "tp": self.tp, **asdict(self.coef)}
