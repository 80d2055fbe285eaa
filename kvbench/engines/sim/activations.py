"""Activation memory of one forward step, per tensor-parallel rank, from the model shape and
the step's batch shape: the tensors alive at the step's peak, by name.

The decoder is the built-in engine's (``kvbench/engines/model/llama.py``, the layout of
Hugging Face's ``LlamaForCausalLM`` and close to vLLM's): a flat batch of ``T`` tokens, every
layer holding

- the embedding output (the executor keeps it for the whole forward) and the layer's input;
- in attention: the normed input, q, k, v, the attention output, and the attention kernel's
  workspace (below);
- in the MLP: the residual after attention, the normed residual, and ``silu(gate) * up``:
  three ``[T, intermediate]`` tensors at once (vLLM's fused ``gate_up`` plus its activation
  hold the same three);
- after the last layer: the final hidden states, the sampled rows and their logits
  ``[S, vocab]`` in the model dtype plus their float32 copy.

The peak is the larger phase on top of what the whole forward holds (token ids, positions
and slot mapping as int64, RoPE's float32 cos/sin ``[T, head_dim / 2]`` each, the embedding
output). Transients below a phase's peak (RMSNorm's float32 intermediates, RoPE's half-size
products) are left out: on the shapes the CPU check measures they stay under the MLP phase.

Attention kernels (``attention_impl``), each attending the step's prefill chunks one at a
time, as varlen engines do (the torch reference, vLLM's TORCH_SDPA backend):

- ``fused``: FlashAttention-style kernels read the KV cache in place and keep no
  ``[q, k]`` buffer: only the float32 log-sum-exp ``[heads, T]``.
- ``cpu-reference``: the torch reference kernels on the CPU (``kvbench/kernels/reference.py``):
  prefill chunks and long decodes read the cache in place through torch's fused CPU
  attention (the float32 log-sum-exp only, as ``fused``), while short decodes (K+V of at
  most ``SHORT_DECODE_BYTES`` each) share one call over a padded copy of their keys in
  whole pages, in the model dtype, with an additive mask ``[n, padded]`` in the model
  dtype. A batch counts as short when its longest decode is. A chunk on top of earlier
  keys attends them and its own causal square as two pieces merged by their log-sum-exps.
- ``sdpa-dense-mask``: an unfused SDPA path (vLLM's TORCH_SDPA backend is of this kind):
  ``scaled_dot_product_attention``
  over context K/V gathered into contiguous tensors (whole pages of a paged cache), with q, k
  and v in float32 (copies when the model runs in half precision) and a dense boolean
  causal mask ``[q, k]`` repeated over the query heads that share a KV head (queries
  grouped ``[kv_heads, group x q, d]``), which SDPA converts to an additive float32 mask
  and broadcasts over the KV heads. With an explicit mask and three-dimensional inputs
  SDPA takes its math kernel, which holds the scores and their softmax ``[heads, q, k]`` in
  float32 and its safe softmax's boolean "row fully masked" test. Decodes run as one batch
  padded to the longest context, four-dimensional, so SDPA runs them fused (gathered K/V
  and the mask only). This is the seeds' C16 "dense bool mask broadcast inside SDPA".
- ``eager``: Hugging Face's ``eager_attention_forward``: K/V repeated to every query head,
  ``softmax(q k^T * scale + mask, dtype=float32).to(dtype)``: the scores in the model dtype
  and their float32 softmax (with, in half precision, softmax's float32 copy of its input)
  alive at once; the additive causal mask ``[q, k]`` of every chunk is built once per
  forward and held through all layers.

Per rank: query heads and the MLP's intermediate size are split by the tensor-parallel
degree, KV heads too (replicated when there are fewer KV heads than ranks), hidden states
are whole on every rank, and every rank is modelled as the one that gathers the full logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvbench.engines.builtin.executor import ScheduledSeq
from kvbench.engines.model.presets import ModelPreset

AttentionImpl = Literal["fused", "cpu-reference", "sdpa-dense-mask", "eager"]

FP32 = 4
INT64 = 8
# Parts of the peak that belong to the attention kernel (its workspace and masks); the rest
# are the linear layers' tensors.
ATTENTION_PARTS = frozenset({"attention_workspace", "attention_masks"})


@dataclass(frozen=True, slots=True)
class ForwardShape:
    """What the activation model needs of one step: ``num_tokens`` tokens in the flat batch,
    ``num_sampled`` rows whose logits are computed, each prefill chunk as (new tokens ``q``,
    keys ``k`` = cached + new), and the decodes (one token each) with their longest context."""

    num_tokens: int
    num_sampled: int
    chunks: tuple[tuple[int, int], ...] = ()
    num_decodes: int = 0
    max_decode_context: int = 0

    @classmethod
    def profile(cls, num_tokens: int, max_num_seqs: int) -> ForwardShape:
        """vLLM's memory-profiling batch (``gpu_model_runner.profile_run``/``_dummy_run``):
        ``num_tokens`` (``max_num_batched_tokens``) spread evenly over ``min(max_num_seqs,
        num_tokens)`` fresh prefills, the remainder on the last, one sampled row each."""
        seqs = max(1, min(max_num_seqs, num_tokens))
        each, rest = divmod(num_tokens, seqs)
        lengths = [each] * seqs
        lengths[-1] += rest
        return cls(num_tokens, seqs, tuple((n, n) for n in lengths if n > 0))


@dataclass(frozen=True, slots=True)
class EncoderShape:
    """A vision or audio encoder tower: pre-norm transformer layers with bidirectional
    attention and a GELU MLP."""

    width: int
    heads: int
    mlp: int


# CLIP ViT-L/14 (openai/clip-vit-large-patch14-336: hidden 1024, 16 heads, MLP 4096), the
# tower of LLaVA-1.5 and the ViT-L/14 the token rules count patches for.
VISION_TOWER = EncoderShape(width=1024, heads=16, mlp=4096)
# Whisper large-v3's encoder (d_model 1280, 20 heads, FFN 5120): 50 positions per second.
AUDIO_TOWER = EncoderShape(width=1280, heads=20, mlp=5120)


@dataclass(frozen=True, slots=True)
class ActivationPeak:
    """The tensors alive at a step's peak, by name, in bytes per rank."""

    phase: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def attention(self) -> int:
        """Of ``total``, the attention kernel's workspace and masks."""
        return sum(v for k, v in self.parts.items() if k in ATTENTION_PARTS)


@dataclass(frozen=True, slots=True)
class ActivationModel:
    preset: ModelPreset
    tp: int = 1
    attention: AttentionImpl = "fused"
    # Token slots per KV page: an unfused kernel gathers a paged context in whole pages.
    page_tokens: int = 1
    # Per-rank shape, fixed at construction.
    _hq: int = field(init=False, repr=False, default=0)
    _hk: int = field(init=False, repr=False, default=0)
    _inter: int = field(init=False, repr=False, default=0)

    def __post_init__(self) -> None:
        p, tp = self.preset, self.tp
        object.__setattr__(self, "_hq", max(1, p.num_heads // tp))
        object.__setattr__(self, "_hk", p.num_kv_heads // min(tp, p.num_kv_heads))
        object.__setattr__(self, "_inter", -(-p.intermediate_size // tp))

    def peak(self, shape: ForwardShape) -> ActivationPeak:
        """The decoder's peak over the phases of one forward of ``shape``."""
        p, b = self.preset, self.preset.dtype_bytes
        t, s, h, d = shape.num_tokens, shape.num_sampled, p.hidden_size, p.head_dim
        if t == 0:
            return ActivationPeak("idle")
        whole = {
            "step_inputs": 3 * t * INT64 + s * INT64,
            "rope_cos_sin": t * d * FP32,
            "embeddings": t * h * b,
        }
        held = self._held_masks(shape)
        if held:
            whole["attention_masks"] = held
        qkvo = t * (2 * self._hq + 2 * self._hk) * d * b
        phases = {
            "attention": {
                "layer_input": t * h * b, "normed": t * h * b, "qkv_and_output": qkvo,
                "attention_workspace": self._workspace(shape),
            },
            "mlp": {
                "layer_input": t * h * b, "residual_and_normed": 2 * t * h * b,
                "mlp_intermediate": 3 * t * self._inter * b,
            },
            "logits": {
                "final_hidden": t * h * b, "sampled_rows": 2 * s * h * b,
                "logits": s * p.vocab_size * (b + (FP32 if b != FP32 else 0)),
            },
        }
        name, parts = max(phases.items(), key=lambda kv: sum(kv[1].values()))
        return ActivationPeak(name, whole | parts)

    def split(self, shape: ForwardShape) -> tuple[int, int]:
        """:meth:`peak`'s total less its attention part, and that part (the same sums, taken
        without naming the tensors: device memory asks for every step's)."""
        p, b = self.preset, self.preset.dtype_bytes
        t, s, h = shape.num_tokens, shape.num_sampled, p.hidden_size
        if t == 0:
            return 0, 0
        held = self._held_masks(shape)
        whole = 3 * t * INT64 + s * INT64 + t * p.head_dim * FP32 + t * h * b
        workspace = self._workspace(shape)
        attention = (2 * t * h * b + t * (2 * self._hq + 2 * self._hk) * p.head_dim * b
                     + workspace)
        mlp = 3 * t * h * b + 3 * t * self._inter * b
        logits = t * h * b + 2 * s * h * b + s * p.vocab_size * (b + (FP32 if b != FP32 else 0))
        # The first of equal phases wins, as max() over the phases in order picks it.
        if attention >= mlp and attention >= logits:
            return whole + attention - workspace, held + workspace
        return whole + max(mlp, logits), held

    def peak_key(self, shape: ForwardShape) -> object:
        """What :meth:`peak` reads of ``shape`` under this kernel: a fused kernel keeps no
        workspace that grows with the context, so its peak is that of the token counts."""
        if self.attention == "fused":
            return shape.num_tokens, shape.num_sampled
        return shape

    def encoder_peak(self, tower: EncoderShape, segment_tokens: list[int]) -> int:
        """Peak of one encoder forward over the segments encoded in a step (batched: their
        tokens side by side; attention per segment): the residual, the normed input and the
        MLP's two ``[N, mlp]`` tensors, plus, for eager attention, the largest segment's
        scores (an encoder attends without a mask, so SDPA runs fused)."""
        if not segment_tokens:
            return 0
        b = self.preset.dtype_bytes
        n = sum(segment_tokens)
        linear = n * (2 * tower.width + 2 * tower.mlp) * b
        if self.attention != "eager":
            return linear
        longest = max(segment_tokens)
        return linear + tower.heads * longest * longest * self._eager_score_bytes()

    def _held_masks(self, shape: ForwardShape) -> int:
        """Masks built once per forward and held through every layer."""
        if self.attention != "eager":
            return 0
        return sum(q * k for q, k in shape.chunks) * self.preset.dtype_bytes

    def _workspace(self, shape: ForwardShape) -> int:
        """The attention kernel's largest transient: the decode batch or one prefill chunk."""
        if self.attention == "cpu-reference":
            merges = max((self._merge(q, k) for q, k in shape.chunks), default=0)
            return self._hq * shape.num_tokens * FP32 + max(self._short_decodes(shape), merges)
        if self.attention == "fused":
            return self._hq * shape.num_tokens * FP32
        largest = max((self.chunk_workspace(q, k) for q, k in shape.chunks), default=0)
        if shape.num_decodes:
            largest = max(largest, self._decodes(shape.num_decodes, shape.max_decode_context))
        return largest

    def chunk_workspace(self, q: int, k: int) -> int:
        """The attention workspace of one prefill chunk of ``q`` new tokens and ``k`` keys."""
        if self.attention == "cpu-reference":
            return self._hq * q * FP32 + self._merge(q, k)
        if self.attention == "fused":
            return self._hq * q * FP32
        if self.attention == "sdpa-dense-mask":
            return self._chunk_sdpa(q, k)
        return self._chunk_eager(q, k)

    def _merge(self, q: int, k: int) -> int:
        """The CPU reference's merge of a chunk's two pieces (the keys before it, its causal
        square): both outputs and their stacked copy in the model dtype, weights times
        outputs and their sum in float32, and the log-sum-exps."""
        if k <= q:
            return 0
        b = self.preset.dtype_bytes
        vectors = q * self._hq * self.preset.head_dim
        # In half precision a further float32 output is alive at the merge's peak: measured
        # with torch's CPU allocator profile (the fused kernel's float32 accumulation), not
        # derived from its source.
        upcast = vectors * FP32 if b != FP32 else 0
        return 2 * self._hq * q * FP32 + vectors * (4 * b + 3 * FP32) + upcast

    def _short_decodes(self, shape: ForwardShape) -> int:
        """The CPU reference's padded copy of short decodes' keys and its mask."""
        from kvbench.kernels.reference_plan import SHORT_DECODE_BYTES

        n, context = shape.num_decodes, shape.max_decode_context
        if n < 2 or context * 2 * self._hk * self.preset.head_dim * self.preset.dtype_bytes > (
            SHORT_DECODE_BYTES
        ):
            return 0
        pages = -(-context // self.page_tokens) * self.page_tokens
        return n * (self.gathered_kv_bytes(context) + pages * self.preset.dtype_bytes)

    def gathered_kv_bytes(self, k: int) -> int:
        """Context K and V copied into contiguous tensors for an unfused kernel."""
        pages = -(-k // self.page_tokens) * self.page_tokens
        return 2 * pages * self._hk * self.preset.head_dim * self.preset.dtype_bytes

    def _upcast_kv(self, k: int) -> int:
        """The float32 copies of gathered K and V a half-precision model's SDPA path makes."""
        if self.preset.dtype_bytes == FP32:
            return 0
        pages = -(-k // self.page_tokens) * self.page_tokens
        return 2 * pages * self._hk * self.preset.head_dim * FP32

    def _chunk_sdpa(self, q: int, k: int) -> int:
        hq, hk, d = self._hq, self._hk, self.preset.head_dim
        group = hq // hk
        # Causal, repeated over the group, converted to float32 by SDPA.
        mask = q * k + group * q * k * (1 + FP32)
        # Scores and softmax, and the boolean "row fully masked" test of its safe softmax.
        scores = 2 * hq * q * k * FP32 + hq * q * k
        # Grouped float32 queries, the math kernel's scaled query and its output.
        vectors = 3 * hq * q * d * FP32
        return self.gathered_kv_bytes(k) + self._upcast_kv(k) + mask + scores + vectors

    def _chunk_eager(self, q: int, k: int) -> int:
        hq, d, b = self._hq, self.preset.head_dim, self.preset.dtype_bytes
        repeated = 2 * hq * k * d * b
        return self.gathered_kv_bytes(k) + repeated + hq * q * k * self._eager_score_bytes()

    def _eager_score_bytes(self) -> int:
        """Bytes per score element at eager attention's peak: the scores, and inside
        ``softmax(dtype=float32)`` a float32 copy of half-precision input (torch skips it
        only for float16 on CUDA) and the float32 output; the cast back comes after the
        copy is freed."""
        b = self.preset.dtype_bytes
        return b + FP32 + (FP32 if b != FP32 else 0)

    def _decodes(self, n: int, context: int) -> int:
        """One padded batch of ``n`` decodes attending up to ``context`` keys each."""
        hq, d, b = self._hq, self.preset.head_dim, self.preset.dtype_bytes
        gathered = n * self.gathered_kv_bytes(context)
        if self.attention == "eager":
            return (gathered + 2 * n * hq * context * d * b
                    + n * hq * context * self._eager_score_bytes())
        # Four-dimensional decode inputs let SDPA take a fused kernel despite the mask.
        return gathered + n * self._upcast_kv(context) + n * context * (1 + FP32)


def forward_shape(items: Sequence[ScheduledSeq]) -> ForwardShape:
    """The :class:`ForwardShape` of a scheduled batch: a one-token item of a sequence that
    already has output is a decode, anything else a prefill chunk (as ``batch_shape``)."""
    tokens = sampled = decodes = longest = 0
    chunks = []
    for item in items:
        n, end = item.num_tokens, item.start + item.num_tokens
        tokens += n
        sampled += item.sample
        if n == 1 and item.seq.output_ids:
            decodes += 1
            longest = max(longest, end)
        else:
            chunks.append((n, end))
    return ForwardShape(tokens, sampled, tuple(chunks), decodes, longest)
