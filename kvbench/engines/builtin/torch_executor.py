"""The torch executor: real compute for the built-in engine, on CPU or CUDA.

Each step is one forward over the flat batch of every scheduled prefill chunk and decode.
KV lives in one pool tensor whose slots are exactly the KV manager's slots; the layout the
manager describes for each batch (block tables, extents, ...) picks the attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvbench.engines.builtin.executor import Executor, ScheduledBatch
from kvbench.engines.builtin.host_kv import HostKV
from kvbench.engines.builtin.torch_device import TORCH_DTYPES, resolve_device, zeros
from kvbench.engines.kv.base import KVManager
from kvbench.engines.kv.spec import LayerPools
from kvbench.engines.model.encoders import Encoders
from kvbench.engines.model.llama import AttentionBatch, greedy
from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.model.weights import build_model
from kvbench.errors import KvbenchError
from kvbench.kernels.backend import get_backend


@dataclass(frozen=True, slots=True)
class _StepInputs:
    """One step's flat batch on the device (``*_host``: the host arrays some callers need)."""

    token_ids: Tensor
    positions: Tensor
    slots: Tensor
    slots_host: np.ndarray
    cu: Tensor
    cu_host: np.ndarray
    ctx: Tensor
    sample_rows: Tensor
    layout: Any


class TorchExecutor(Executor):
    """Runs ``preset`` for real on ``device`` (``cpu``, ``cuda``, ``cuda:N``).

    ``dtype`` overrides the preset's; ``weights`` is a local Hugging Face checkpoint
    directory (else random weights from ``seed``); ``attention`` names the kernel backend.
    """

    def __init__(
        self,
        preset: ModelPreset,
        device: str = "cpu",
        dtype: str | None = None,
        weights: str | None = None,
        seed: int = 0,
        attention: str = "reference",
    ) -> None:
        self._device = resolve_device(device)
        self.device = str(self._device)
        self.preset = preset.with_dtype(dtype) if dtype is not None else preset
        self.dtype = TORCH_DTYPES[self.preset.dtype]
        self.kernels = get_backend(attention, self._device)
        self.weights = weights
        self.seed = seed
        self.model = build_model(self.preset, self.kernels, self._device, weights, seed)
        self.encoders = Encoders(self.preset.hidden_size, self._device, self.dtype, seed)
        self._pool: Tensor | None = None
        self._host: HostKV | None = None  # behind a cpu offload tier
        self._classes: Any = None  # ClassPools of a modality-aware pool
        self._layers: LayerPools | None = None  # layer groups allocated apart
        self._plan: Any = None  # the last step's attention plan, which the next may carry on
        # With keep_logits, the last step's logits [sampled items, vocab] (quality probes).
        self.keep_logits = False
        self.last_logits: Tensor | None = None

    @property
    def kv_pool_bytes(self) -> int:
        if self._classes is not None:
            return self._classes.nbytes
        return 0 if self._pool is None else self._pool.nbytes

    def encoder_cache_bytes(self) -> int:
        return self.encoders.cache_bytes

    def bind(self, kv: KVManager) -> None:
        p = self.preset
        if kv.bytes_per_token != p.kv_bytes_per_token:
            raise KvbenchError(
                f"KV manager sized for {kv.bytes_per_token} bytes/token but {p.name} in "
                f"{p.dtype} stores {p.kv_bytes_per_token}; build both from the same preset "
                "and dtype"
            )
        self._pool = self._host = None  # a rebind must not hold two pools at once
        self._classes = None
        self._plan = None
        pool_classes = getattr(kv, "pool_classes", None)  # managers of one flat pool may lack it
        classes = pool_classes() if pool_classes is not None else None
        if classes is not None:
            from kvbench.engines.kv.class_pools import ClassPools

            self._classes = ClassPools(p, classes, self._device)
            return
        # One tensor for all layers: the KV budget is exactly one allocation of
        # capacity_tokens x bytes_per_token (no per-layer allocator slack), and a slot copy
        # moves every layer's K and V in one indexing op. Layer groups allocated apart
        # share tensors as their pool lays them out.
        layer_pools = getattr(kv, "layer_pools", None)  # as pool_classes, above
        self._layers = layer_pools() if layer_pools is not None else None
        tensors, slots = ((p.num_layers, kv.capacity_tokens) if self._layers is None
                          else (self._layers.tensors, self._layers.slots))
        # Latent attention caches one vector a token (latent and RoPE key), read as both.
        per_slot = ((2, p.num_kv_heads, p.head_dim) if p.latent is None
                    else (1, 1, p.latent.kv_lora_rank + p.latent.qk_rope_dim))
        self._pool = zeros(
            (tensors, per_slot[0], slots, *per_slot[1:]),
            self.dtype, self._device, f"KV pool of {slots} tokens",
        )
        tiers = getattr(kv, "offload", None)
        if tiers is not None and tiers.host is not None:
            self._host = HostKV(self._pool, tiers)

    def execute(self, batch: ScheduledBatch, kv: KVManager) -> list[int]:
        if self._classes is not None:
            return self._execute_classes(batch, kv)
        if self._pool is None:
            raise KvbenchError("execute() before bind(): the KV pool is not allocated")
        pool = self._pool
        if self._host is not None:
            self._host.apply(pool)
        if batch.copies:
            self.kernels.copy_slots(pool.view(-1, *pool.shape[2:]), batch.copies)
        if not batch.items:
            return []
        step = self._step_inputs(batch, kv)
        layers = None
        if self._layers is not None:
            layers = self._layer_batches(step, batch, kv)
            attn = layers[0][1]
        else:
            # Every layer reads the same layout: the kernels plan it once for the step,
            # carrying on the last step's plan where they can (decodes one key further).
            plan = step.layout.plan(self.kernels, step.ctx, step.cu, pool[0, 0], pool[0, -1],
                                    self.preset.num_heads, window=self.preset.sliding_window,
                                    previous=self._plan)
            self._plan = plan
            attn = AttentionBatch(step.slots, step.cu, step.ctx, step.layout, plan)

        with torch.inference_mode():
            hidden = self.model.embed(step.token_ids)
            self._insert_encoder_outputs(hidden, batch, step.cu_host)
            logits = self.model(hidden, step.positions, attn, pool, step.sample_rows, layers)
            self.last_logits = logits if self.keep_logits else None
            return greedy(logits).tolist()

    def _layer_batches(self, step: _StepInputs, batch: ScheduledBatch,
                       kv: Any) -> list[tuple[Tensor, AttentionBatch]]:
        """Each layer's cache tensor and batch where layer groups are allocated apart: a
        group's slots and block tables, planned once per window its layers have."""
        layers, pool = self._layers, self._pool
        assert layers is not None and pool is not None
        seqs = [it.seq for it in batch.items]
        ctx = np.array([it.start + it.num_tokens for it in batch.items], dtype=np.int64)
        inputs: dict[int, tuple[Tensor, Any]] = {0: (step.slots, step.layout)}
        batches: dict[tuple[int, int | None], AttentionBatch] = {}
        out = []
        for tensor, group, window in zip(layers.tensor_of, layers.group_of,
                                         self.preset.layer_windows, strict=True):
            if group not in inputs:
                slots = np.concatenate([kv.slots(it.seq, it.start, it.start + it.num_tokens,
                                                 group=group) for it in batch.items])
                layout = kv.attention_layout(seqs, ctx, group=group).on(self._device)
                inputs[group] = (torch.from_numpy(slots).to(self._device), layout)
            attn = batches.get((group, window))
            if attn is None:
                slots, layout = inputs[group]
                plan = layout.plan(self.kernels, step.ctx, step.cu, pool[tensor, 0],
                                   pool[tensor, -1], self.preset.num_heads, window=window)
                attn = batches[group, window] = AttentionBatch(slots, step.cu, step.ctx,
                                                               layout, plan)
            out.append((pool[tensor], attn))
        return out

    def _execute_classes(self, batch: ScheduledBatch, kv: KVManager) -> list[int]:
        """``execute`` over a pool of several page classes."""
        if batch.copies:
            self._classes.copy(batch.copies)
        if not batch.items:
            return []
        step = self._step_inputs(batch, kv)
        self._classes.begin(self.kernels, step.layout, step.slots_host, step.positions,
                            step.cu, self.preset.num_heads)
        attn = AttentionBatch(step.slots, step.cu, step.ctx, step.layout)
        with torch.inference_mode():
            hidden = self.model.embed(step.token_ids)
            self._insert_encoder_outputs(hidden, batch, step.cu_host)
            logits = self.model(hidden, step.positions, attn, self._classes, step.sample_rows)
            self.last_logits = logits if self.keep_logits else None
            return greedy(logits).tolist()

    def _step_inputs(self, batch: ScheduledBatch, kv: KVManager) -> _StepInputs:
        """The flat batch of a step: token ids, positions, slots, query and context lengths,
        sampled rows and the KV layout, on the executor's device."""
        items = batch.items
        spans = [(it.seq, it.start, it.start + it.num_tokens) for it in items]
        lens = np.array([it.num_tokens for it in items], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)])
        ctx = np.array([end for _, _, end in spans], dtype=np.int64)
        token_ids = np.concatenate([seq.token_ids(start, end) for seq, start, end in spans])
        # Row r of sequence b sits at position start_b + (r - cu_b).
        positions = np.arange(cu[-1]) + np.repeat(ctx - lens - cu[:-1], lens)
        slots = np.concatenate([kv.slots(seq, start, end) for seq, start, end in spans])
        sample_rows = np.array([cu[i + 1] - 1 for i, it in enumerate(items) if it.sample], np.int64)

        def dev(a: np.ndarray, dtype: torch.dtype) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self._device, dtype)

        layout = kv.attention_layout([it.seq for it in items], ctx).on(self._device)
        return _StepInputs(
            dev(token_ids, torch.int64), dev(positions, torch.int64), dev(slots, torch.int64),
            slots, dev(cu, torch.int32), cu, dev(ctx, torch.int32),
            dev(sample_rows, torch.int64), layout,
        )

    def _insert_encoder_outputs(
        self, hidden: Tensor, batch: ScheduledBatch, cu: np.ndarray
    ) -> None:
        """Overwrite the rows of image/audio positions with the slice of their segment's
        encoder output that this chunk covers."""
        rows: list[Tensor] = []
        embeds: list[Tensor] = []
        for i, it in enumerate(batch.items):
            segments = it.seq.request.segments
            if all(s.kind == "text" for s in segments):
                continue
            end = it.start + it.num_tokens
            seg_start = 0
            for s in segments:
                lo, hi = max(seg_start, it.start), min(seg_start + s.tokens, end)
                if s.kind != "text" and lo < hi:
                    embeds.append(self.encoders.embed(s)[lo - seg_start : hi - seg_start])
                    first = int(cu[i]) + lo - it.start
                    rows.append(torch.arange(first, first + hi - lo, device=hidden.device))
                seg_start += s.tokens
                if seg_start >= end:
                    break
        if rows:
            hidden[torch.cat(rows)] = torch.cat(embeds)

    def describe(self) -> dict[str, Any]:
        return {
            "executor": "torch",
            "model": self.preset.name,
            "device": self.device,
            "dtype": self.preset.dtype,
            "attention": self.kernels.name,
            "threads": torch.get_num_threads() if self._device.type == "cpu" else None,
            "weights": self.weights if self.weights is not None else f"random(seed={self.seed})",
            "weight_bytes": sum(p.nbytes for p in self.model.parameters()),
            "packed_weight_bytes": self.model.packed_bytes(),
            "kv_pool_bytes": self.kv_pool_bytes,
            "host_kv_bytes": self._host.nbytes if self._host is not None else None,
            "encoders": self.encoders.describe(),
        }

    def close(self) -> None:
        self._pool = self._host = self._layers = None
        self._classes = None
        self._plan = None
        self.encoders.clear()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
