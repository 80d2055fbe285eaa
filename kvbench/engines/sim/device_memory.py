"""The simulated device's memory, step by step: what a real engine on that device would hold,
per tensor-parallel rank, and whether it fits.

Components (per rank; all ranks hold the same):

- weights: the preset's decoder weights over the ranks (encoder towers are not in the
  presets and not counted);
- the KV cache, by ``kv_allocation``:

  - ``preallocated`` (vLLM): one pool of the run's KV budget, reserved at start-up after a
    profiling forward (``ForwardShape.profile``) whose activation peak the allocator then
    keeps cached; device memory is flat from the start unless a later step needs more
    workspace than the profile did;
  - ``on-demand`` (a Hugging Face ``DynamicCache``): every running sequence owns one K and
    one V tensor per layer holding exactly its computed tokens, grown by concatenation (the
    longer tensor is allocated, then the shorter one freed) and freed when the sequence
    leaves, through the caching allocator (:mod:`kvbench.engines.sim.caching_allocator`), which
    keeps freed blocks reserved; one layer's tensors are simulated and counted once per
    layer (every layer sees the same sizes in the same order). Prefix-cache hits and forked
    samples are copied into a sequence's own tensors, as a dynamic cache shares nothing.
    A policy whose manager keeps finished sequences' pages (``releases_finished`` false)
    keeps their tensors too. The KV manager still decides admission and preemption;

- activations and the attention kernel's workspace of each step
  (:mod:`kvbench.engines.sim.activations`, by ``attention_impl``);
- encoder outputs: an image or audio segment is encoded (a ViT-L/14 or Whisper-large
  encoder's activations) when a prefill chunk first reaches it, and its output ``[tokens,
  hidden]`` stays cached until every sequence that needs it has prefilled past it
  (vLLM v1's encoder cache), shared by segments with the same key;
- allocator overhead: the caching allocator never returns freed memory unless a mapping
  fails, so the workspace (activations, attention, encoder outputs) stays reserved at the
  high-water mark of step peaks, in 2 MiB segment units; on-demand KV carries the
  allocator model's rounding and fragmentation; on a failed mapping the allocator releases
  its free segments and retries, and only what still does not fit is out of memory.
  Weights and a preallocated pool are a few large allocations whose rounding (< 2 MiB each)
  is ignored;
- non-torch memory: the CUDA context, cuBLAS and NCCL handles, a constant per rank.

``extra_kv_window_tokens`` models the seeds' C16 "sliding window not disabled" as the
report describes it, an extra window of that many keys and values per layer kept for each
running sequence: on-demand, per-layer K/V tensors of that length beside each sequence's
own; preallocated, the window lives inside the pool (it costs pages, not device memory) and
is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvbench.engines.base import DeviceMemory
from kvbench.engines.builtin.executor import ScheduledBatch, ScheduledSeq
from kvbench.engines.kv.base import KVManager
from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.sequence import SeqStatus, Sequence
from kvbench.engines.sim.activations import (
    AUDIO_TOWER,
    VISION_TOWER,
    ActivationModel,
    AttentionImpl,
    ForwardShape,
    forward_shape,
)
from kvbench.engines.sim.caching_allocator import ROUND_LARGE, CachingAllocator
from kvbench.units import format_bytes
from kvbench.workloads.model import Segment

KVAllocation = Literal["preallocated", "on-demand"]

# CUDA context plus cuBLAS/cuDNN/NCCL handles: a process that has initialised CUDA and
# loaded torch's kernels (CUDA_MODULE_LOADING=LAZY) shows 300-600 MiB in nvidia-smi on
# A100/H100-class devices before allocating a tensor; the middle of that range. vLLM's KV
# budget takes off only the non-torch memory that grows after its start-up snapshot
# (``Hardware.non_torch_bytes``): the context exists before it, in the share
# gpu_memory_utilization leaves.
NON_TORCH_BYTES = 512 * 2**20
# Activation peaks kept for recurring forward shapes (cleared when full).
_PEAKS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    """How a simulated device's memory is modelled (suite ``[run]`` fields of the same
    names)."""

    attention_impl: AttentionImpl = "fused"
    kv_allocation: KVAllocation = "preallocated"
    extra_kv_window_tokens: int = 0


def _segments_up(nbytes: int) -> int:
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


class DeviceOutOfMemory(Exception):
    """A modelled step (or start-up) that needs more device memory than a rank has: the
    outcome a real engine meets as CUDA's out-of-memory error. ``needed`` is the
    breakdown of what the step would hold, summed over ranks; ``in_use_bytes`` what was in
    use per rank before it."""

    def __init__(self, when: str, needed: DeviceMemory, memory_bytes: int, in_use_bytes: int,
                 hint: str) -> None:
        self.needed = needed
        self.memory_bytes = memory_bytes
        self.in_use_bytes = in_use_bytes
        tp = needed.tp
        parts = ", ".join(f"{name} {format_bytes(v // tp)}"
                          for name, v in needed.components().items() if v)
        super().__init__(
            f"out of device memory {when}: needs {format_bytes(needed.used_bytes // tp)} per "
            f"rank ({parts}) but the device has {format_bytes(memory_bytes)}, "
            f"{format_bytes(max(0, memory_bytes - in_use_bytes))} of it free; {hint}"
        )

    @property
    def needed_bytes(self) -> int:
        """Per rank."""
        return self.needed.used_bytes // self.needed.tp

    @property
    def free_bytes(self) -> int:
        """Per rank, before the step."""
        return max(0, self.memory_bytes - self.in_use_bytes)


@dataclass(slots=True)
class _SeqKV:
    """One sequence's on-demand tensors (allocator handles) and what it holds."""

    seq: Sequence
    tokens: int = 0
    k: int | None = None
    v: int | None = None
    window: tuple[int, int] | None = None


class DeviceMemoryModel:
    """The device memory of one engine on a simulated device: ``start`` at bind time, then
    ``step`` for every executed batch (``idle`` for a step that executed none)."""

    def __init__(self, preset: ModelPreset, memory_bytes: int, tp: int, options: MemoryOptions,
                 max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.preset = preset
        self.memory_bytes = memory_bytes
        self.tp = tp
        self.options = options
        self._profile = ForwardShape.profile(max_num_batched_tokens, max_num_seqs)
        self._weights = preset.weight_bytes // tp
        self._kv_layers = preset.num_layers
        # One layer's K (or V) of one token on one rank.
        self._kv_token_bytes = preset.kv_bytes_per_token_per_rank(tp) // (2 * preset.num_layers)
        self._encoder_token_bytes = preset.hidden_size * preset.dtype_bytes
        self._activations: ActivationModel | None = None
        self._kv = KVState()
        self._workspace_reserved = 0
        self._encoder = _EncoderCache()
        self._allocator: CachingAllocator | None = None
        self._seqs: dict[int, _SeqKV] = {}
        self._releases_finished = True
        # The reading before departed sequences were freed, when that was done ahead of the
        # step (decode fast-forward).
        self._in_use_before: int | None = None
        self._peaks: dict[object, tuple[int, int]] = {}
        # step_shape's readings by (peak, encoder outputs, workspace kept) before the step,
        # and decode_steps' under a fused kernel by (sequences, encoder outputs, workspace).
        self._fitted: dict[tuple[int, ...], tuple[DeviceMemory, int]] = {}
        self._decodes: dict[tuple[int, ...], tuple[dict[str, int], int]] = {}

    @property
    def activations(self) -> ActivationModel:
        assert self._activations is not None, "start() first"
        return self._activations

    @property
    def on_demand(self) -> bool:
        return self.options.kv_allocation == "on-demand"

    def start(self, kv: KVManager) -> None:
        """Reserve what the engine holds before its first step; raises
        :class:`DeviceOutOfMemory` when that does not fit."""
        self._activations = ActivationModel(self.preset, self.tp, self.options.attention_impl,
                                            kv.spec.page_tokens)
        self._releases_finished = kv.releases_finished
        if self.on_demand:
            self._allocator = CachingAllocator()
            self._kv = KVState()
            hint = "use a larger device or more tensor parallelism (sim:GPUxTP)"
        else:
            pool = kv.capacity_tokens * kv.bytes_per_token // self.tp
            self._kv = KVState(pool, pool)
            self._workspace_reserved = _segments_up(self._activations.peak(self._profile).total)
            hint = ("lower --kv-memory or gpu_memory_utilization, or lower "
                    "max_num_batched_tokens (the profiling batch)")
        snapshot = self._snapshot(0, 0, 0)
        if snapshot.used_bytes // self.tp > self.memory_bytes:
            raise DeviceOutOfMemory("at start-up", snapshot, self.memory_bytes, 0, hint)

    def step(self, batch: ScheduledBatch) -> DeviceMemory:
        """The device memory at the peak of ``batch``; raises :class:`DeviceOutOfMemory` when
        it does not fit even after the allocator released its free segments."""
        assert self._activations is not None, "start() first"
        in_use = self._begin_step()
        if self.on_demand:
            self._grow_kv(batch)
        encoded = self._encoder.acquire(batch.items, self._encoder_token_bytes)
        activation, attention = self._peak(forward_shape(batch.items))
        decoder = activation + attention
        if encoded:
            # One forward per tower over its segments, before the decoder's, with their
            # outputs already cached.
            towers = max(
                self._activations.encoder_peak(tower, [s.tokens for s in encoded if s.kind == kind])
                for kind, tower in (("image", VISION_TOWER), ("audio", AUDIO_TOWER))
            )
            if towers > decoder:
                activation, attention = towers, 0
        encoder = self._encoder.nbytes
        snapshot = self._fit(activation, attention, encoder, in_use)
        self._encoder.release_done(batch.items)
        return snapshot

    def step_shape(self, shape: ForwardShape) -> DeviceMemory:
        """:meth:`step` of a batch of that forward shape whose prompts are all text, with
        KV preallocated: the shape is all the model needs of it. A step whose peak and
        allocator state were seen before reads the same (kept, as steps recur)."""
        assert self._activations is not None and not self.on_demand
        activation, attention = self._peak(shape)
        encoder = self._encoder.nbytes
        key = (activation, attention, encoder, self._workspace_reserved)
        seen = self._fitted.get(key)
        if seen is None:
            snapshot = self._fit(activation, attention, encoder, self._begin_step())
            if len(self._fitted) >= _PEAKS_KEPT:
                self._fitted.clear()
            self._fitted[key] = (snapshot, self._workspace_reserved)
            return snapshot
        self._in_use_before = None
        self._release_departed()
        self._workspace_reserved = seen[1]
        return seen[0]

    def _begin_step(self) -> int:
        """Free what departed sequences held; returns the memory in use per rank before (or
        before the decode steps taken in one go ahead of this one)."""
        in_use = self._in_use_before
        if in_use is None:
            in_use = self._idle_used()
        self._in_use_before = None
        self._release_departed()
        return in_use

    def _idle_used(self) -> int:
        """Per rank, the used memory of :meth:`_snapshot` with no step running (weights, the
        KV the allocator holds, the workspace it keeps, non-torch memory)."""
        return self._weights + self._kv.reserved + self._workspace_reserved + NON_TORCH_BYTES

    def _peak(self, shape: ForwardShape) -> tuple[int, int]:
        """The decoder's activations and attention workspace at the peak of ``shape``, kept
        for shapes that recur (every decode step of a batch of the same size)."""
        acts = self._activations
        assert acts is not None
        key = acts.peak_key(shape)
        out = self._peaks.get(key)
        if out is None:
            if len(self._peaks) >= _PEAKS_KEPT:
                self._peaks.clear()
            out = self._peaks[key] = acts.split(shape)
        return out

    def idle(self) -> DeviceMemory:
        """The device memory of a step that computed nothing."""
        self._release_departed()
        return self._snapshot(0, 0, self._encoder.nbytes)

    def begin_decode(self) -> None:
        """What :meth:`step` does first, ahead of :meth:`decode_steps`: free what departed
        sequences held (keeping the reading from before, which an out-of-memory step
        reports)."""
        if self._in_use_before is None:
            self._in_use_before = self._idle_used()
        self._release_departed()

    def decode_steps(self, num_seqs: int, longest: int, steps: int
                     ) -> tuple[int, dict[str, int | np.ndarray], int]:
        """The device memory of up to ``steps`` consecutive steps that each decode one token
        of ``num_seqs`` sequences, the longest reading ``longest + j`` keys at step ``j``, as
        :meth:`step` would report them one at a time, changing nothing; fewer steps when one
        would not fit (that step runs on its own). Returns the steps, each component's
        per-step values (an int where it holds at every step), and the workspace the
        allocator keeps after the last of them (for :meth:`end_decode`)."""
        assert self._activations is not None, "start() first"
        encoder = self._encoder.nbytes
        fixed = self._activations.attention == "fused"  # its workspace ignores the context
        reserved = self._workspace_reserved
        if fixed:
            key = (num_seqs, encoder, reserved)
            seen = self._decodes.get(key)
            if seen is not None:
                return (steps, *seen) if seen[0] else (0, {}, reserved)
        rows: list[tuple[int, ...]] = []
        for j in range(1 if fixed else steps):
            activation, attention = self._peak(
                ForwardShape(num_seqs, num_seqs, (), num_seqs, longest + j))
            kept = max(reserved, _segments_up(activation + attention + encoder))
            snapshot = self._snapshot_with(kept, activation, attention, encoder)
            if snapshot.used_bytes // self.tp > self.memory_bytes:
                break
            reserved = kept
            rows.append(snapshot.row())
        if fixed:
            # Every step alike: the first step's reading holds for all of them.
            if len(self._decodes) >= _PEAKS_KEPT:
                self._decodes.clear()
            columns = dict(zip(DeviceMemory.COMPONENTS, rows[0], strict=True)) if rows else {}
            self._decodes[key] = (columns, reserved)
            return (steps, columns, reserved) if rows else (0, {}, reserved)
        if not rows:
            return 0, {}, reserved
        values = np.asarray(rows, dtype=np.int64)
        columns: dict[str, int | np.ndarray] = {}
        for name, col in zip(DeviceMemory.COMPONENTS, values.T, strict=True):
            columns[name] = int(col[0]) if col.min() == col.max() else col
        return len(rows), columns, reserved

    def end_decode(self, workspace_reserved: int) -> None:
        """Take the state :meth:`decode_steps` computed for the steps taken."""
        self._workspace_reserved = workspace_reserved
        self._in_use_before = None

    def _snapshot_with(self, reserved: int, activation: int, attention: int,
                       encoder: int) -> DeviceMemory:
        """``_snapshot`` as it would read with ``reserved`` workspace bytes kept."""
        kept, self._workspace_reserved = self._workspace_reserved, reserved
        try:
            return self._snapshot(activation, attention, encoder)
        finally:
            self._workspace_reserved = kept

    def _fit(self, activation: int, attention: int, encoder: int, in_use: int) -> DeviceMemory:
        workspace = activation + attention + encoder
        self._workspace_reserved = max(self._workspace_reserved, _segments_up(workspace))
        # The step's peak holds what an idle step does, its workspace inside the kept part.
        if self._idle_used() <= self.memory_bytes:
            return self._snapshot(activation, attention, encoder)
        # A mapping failed: the allocator frees what it caches and retries once.
        self._workspace_reserved = _segments_up(workspace)
        if self._allocator is not None:
            self._allocator.release_free_segments()
            self._sync_kv()
        snapshot = self._snapshot(activation, attention, encoder)
        if snapshot.used_bytes // self.tp > self.memory_bytes:
            raise DeviceOutOfMemory(
                "in this step", snapshot, self.memory_bytes, in_use,
                "enable chunked prefill or lower max_num_batched_tokens / max_num_seqs, use "
                "fused attention, or a larger device",
            )
        return snapshot

    def _snapshot(self, activation: int, attention: int, encoder: int) -> DeviceMemory:
        tp = self.tp
        workspace = activation + attention + encoder
        workspace_cached = max(0, self._workspace_reserved - workspace)
        return DeviceMemory(
            tp=tp, weights_bytes=self._weights * tp, kv_bytes=self._kv.allocated * tp,
            activation_bytes=activation * tp, attention_bytes=attention * tp,
            encoder_bytes=encoder * tp,
            kv_cached_bytes=(self._kv.reserved - self._kv.allocated) * tp,
            workspace_cached_bytes=workspace_cached * tp,
            non_torch_bytes=NON_TORCH_BYTES * tp,
        )

    # --- on-demand KV ------------------------------------------------------------------

    def _release_departed(self) -> None:
        """Free what sequences that finished or were preempted since the last step held:
        their encoder outputs and, on demand, their KV tensors (unless they finished and the
        manager keeps finished sequences' pages)."""
        self._encoder.release_departed()
        alloc = self._allocator
        if alloc is None:
            return
        for seq_id in [i for i, s in self._seqs.items() if s.seq.status is not SeqStatus.RUNNING]:
            state = self._seqs.pop(seq_id)
            if state.seq.status is SeqStatus.FINISHED and not self._releases_finished:
                continue
            for handle in (state.k, state.v, *(state.window or ())):
                if handle is not None:
                    alloc.free(handle)
        self._sync_kv()

    def _grow_kv(self, batch: ScheduledBatch) -> None:
        alloc = self._allocator
        assert alloc is not None
        per_token, window = self._kv_token_bytes, self.options.extra_kv_window_tokens
        for item in batch.items:
            seq = item.seq
            state = self._seqs.get(seq.seq_id)
            if state is None:
                state = self._seqs[seq.seq_id] = _SeqKV(seq)
                if window:
                    state.window = (alloc.allocate(window * per_token),
                                    alloc.allocate(window * per_token))
            tokens = item.start + item.num_tokens
            if tokens <= state.tokens:
                continue
            # torch.cat: the longer K is allocated before the shorter is freed, then V.
            k = alloc.allocate(tokens * per_token)
            if state.k is not None:
                alloc.free(state.k)
            v = alloc.allocate(tokens * per_token)
            if state.v is not None:
                alloc.free(state.v)
            state.k, state.v, state.tokens = k, v, tokens
        self._sync_kv()

    def _sync_kv(self) -> None:
        if self._allocator is not None:
            layers = self._kv_layers
            self._kv = KVState(self._allocator.allocated * layers,
                               self._allocator.reserved * layers)


@dataclass(frozen=True, slots=True)
class KVState:
    """KV bytes per rank that tensors hold and that the allocator reserves for them."""

    allocated: int = 0
    reserved: int = 0


class _EncoderCache:
    """Encoder outputs of image and audio segments, by segment, with the sequences still
    needing each."""

    def __init__(self) -> None:
        self._holders: dict[Segment, set[int]] = {}
        self._bytes: dict[Segment, int] = {}
        self._held: dict[int, tuple[Sequence, set[Segment]]] = {}
        self._spans: dict[str, tuple[tuple[int, Segment], ...]] = {}
        self.nbytes = 0

    def _media(self, seq: Sequence) -> tuple[tuple[int, Segment], ...]:
        """(first position, segment) of the request's image and audio segments."""
        rid = seq.request.id
        spans = self._spans.get(rid)
        if spans is None:
            out, pos = [], 0
            for s in seq.request.segments:
                if s.kind != "text":
                    out.append((pos, s))
                pos += s.tokens
            spans = self._spans[rid] = tuple(out)
        return spans

    def acquire(self, items: list[ScheduledSeq], token_bytes: int) -> list[Segment]:
        """Take the segments this batch's chunks reach; returns those encoded now."""
        encoded = []
        for item in items:
            spans = self._media(item.seq)
            if not spans:
                continue
            lo, hi, sid = item.start, item.start + item.num_tokens, item.seq.seq_id
            for start, seg in spans:
                if start < hi and start + seg.tokens > lo:
                    held = self._held.setdefault(sid, (item.seq, set()))[1]
                    if seg in held:
                        continue
                    held.add(seg)
                    holders = self._holders.setdefault(seg, set())
                    if not holders:
                        self._bytes[seg] = seg.tokens * token_bytes
                        self.nbytes += self._bytes[seg]
                        encoded.append(seg)
                    holders.add(sid)
        return encoded

    def release_done(self, items: list[ScheduledSeq]) -> None:
        """Drop the segments each chunk has prefilled past."""
        for item in items:
            entry = self._held.get(item.seq.seq_id)
            if entry is not None:
                end = item.start + item.num_tokens
                for start, seg in self._media(item.seq):
                    if start + seg.tokens <= end and seg in entry[1]:
                        self._drop(item.seq.seq_id, seg)

    def release_departed(self) -> None:
        """Drop everything sequences no longer running hold."""
        for sid in [i for i, (seq, _) in self._held.items() if seq.status is not SeqStatus.RUNNING]:
            for seg in list(self._held[sid][1]):
                self._drop(sid, seg)
            del self._held[sid]

    def _drop(self, seq_id: int, seg: Segment) -> None:
        self._held[seq_id][1].discard(seg)
        holders = self._holders[seg]
        holders.discard(seq_id)
        if not holders:
            del self._holders[seg]
            self.nbytes -= self._bytes.pop(seg)
