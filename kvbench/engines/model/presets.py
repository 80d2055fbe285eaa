"""Model presets: real model shapes, from which KV bytes per token, weight bytes and FLOPs follow.

Shapes are those of the published Hugging Face ``config.json`` files. A preset's KV is a list
of layer groups (:mod:`kvbench.engines.model.layers`): one group of full or sliding-window
attention for a Llama-style model, latent attention for DeepSeek's, several for hybrids.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvbench.engines.model.layers import LayerGroup
from kvbench.errors import KvbenchError
from kvbench.units import did_you_mean

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Weights may be stored narrower than the activations and KV (DeepSeek-V3's FP8 blocks).
WEIGHT_DTYPE_BYTES = {**DTYPE_BYTES, "float8": 1}


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """Multi-head latent attention's projections (DeepSeek-V2/V3). Decode attends in the
    absorbed form, reading only the latent cache; prefill decompresses K and V per head."""

    q_lora_rank: int | None  # None: queries projected from the hidden state directly
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int

    def params(self, hidden: int, heads: int) -> int:
        qk = self.qk_nope_dim + self.qk_rope_dim
        r = self.q_lora_rank
        q = hidden * heads * qk if r is None else hidden * r + r + r * heads * qk
        kv = (hidden * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_nope_dim + self.v_head_dim))
        return q + kv + heads * self.v_head_dim * hidden

    def flops_per_pair(self, heads: int, decode: bool) -> int:
        """FLOPs of one query x key pair in one layer: absorbed for a decoding query (scores
        over the latent and RoPE dims, values over the latent), and for prefill the
        decompressed form vLLM computes (scores over the query-key head dims, values over
        ``v_head_dim``)."""
        if decode:
            return 2 * heads * (2 * self.kv_lora_rank + self.qk_rope_dim)
        return 2 * heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)


@dataclass(frozen=True, slots=True)
class GatedDeltaNet:
    """Qwen3-Next's linear-attention layers: every ``full_attention_interval``-th layer is
    full (gated) attention, the rest Gated DeltaNet with a fixed-size state per sequence."""

    full_attention_interval: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    def params(self, hidden: int) -> int:
        k, v = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        proj = hidden * (2 * k + 2 * v) + hidden * 2 * self.v_heads + v * hidden
        return proj + (2 * k + v) * self.conv_kernel + 2 * self.v_heads + self.v_dim

    def state_bytes(self, dtype_bytes: int) -> int:
        """One layer's state per sequence: each value head's k_dim x v_dim recurrent matrix,
        and the causal convolution's last ``conv_kernel - 1`` inputs of q, k and v."""
        recurrent = self.v_heads * self.k_dim * self.v_dim
        conv = (2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim) * (self.conv_kernel - 1)
        return (recurrent + conv) * dtype_bytes


@dataclass(frozen=True, slots=True)
class MixtureOfExperts:
    """MoE MLPs: every layer after the first ``dense_layers`` routes each token to
    ``active`` of ``experts`` experts (``intermediate_size`` each) plus shared experts of
    ``shared_intermediate`` in all. All experts count for memory, active ones for compute."""

    experts: int
    active: int
    intermediate_size: int
    shared_intermediate: int = 0
    dense_layers: int = 0

    def params(self, hidden: int, active_only: bool) -> int:
        routed = self.active if active_only else self.experts
        experts = 3 * hidden * (routed * self.intermediate_size + self.shared_intermediate)
        return experts + hidden * self.experts  # the router


@dataclass(frozen=True, slots=True)
class ModelPreset:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    dtype: str = "bfloat16"
    qkv_bias: bool = False
    tie_embeddings: bool = False
    hf_architecture: str = "LlamaForCausalLM"
    # Sliding-window attention: each token attends to the last ``sliding_window`` positions
    # (itself included) in every layer; None: full attention.
    sliding_window: int | None = None
    # Heterogeneous models: their layer groups, summing to num_layers (empty: every layer
    # full attention, or the sliding window above), and the shapes their layers add.
    kv_groups: tuple[LayerGroup, ...] = ()
    latent: LatentAttention | None = None
    linear: GatedDeltaNet | None = None
    moe: MixtureOfExperts | None = None
    weight_dtype: str | None = None  # None: weights stored as ``dtype``

    def __post_init__(self) -> None:
        if self.kv_groups and sum(g.layers for g in self.kv_groups) != self.num_layers:
            raise KvbenchError(f"model preset {self.name!r}: its layer groups do not add up "
                               f"to its {self.num_layers} layers")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        if self.kv_groups:
            return self.kv_groups
        if self.sliding_window is None:
            return (LayerGroup("full", self.num_layers, self.num_kv_heads, self.head_dim),)
        return (LayerGroup("sliding", self.num_layers, self.num_kv_heads, self.head_dim,
                           window=self.sliding_window),)

    @property
    def layer_group_of(self) -> tuple[int, ...]:
        """The index in :attr:`layer_groups` of each layer's group, in layer order: the
        groups interleave in their order, in the smallest repeating unit of their layer
        counts (Gemma-2: sliding, full, sliding, ...; Qwen3-Next: three state, one full)."""
        groups = self.layer_groups
        unit = math.gcd(*(g.layers for g in groups))
        pattern = [i for i, g in enumerate(groups) for _ in range(g.layers // unit)]
        return tuple(pattern * unit)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, in layer order (None: it reads its whole context)."""
        windows = [g.window if g.kind == "sliding" else None for g in self.layer_groups]
        return tuple(windows[i] for i in self.layer_group_of)

    def mixed_kv(self) -> str | None:
        """Why one pool of per-token KV cannot hold this model's state, or None: it has
        several kinds of layer group, or per-sequence state."""
        kinds = sorted({g.kind for g in self.layer_groups})
        if len(kinds) > 1:
            return (f"{self.name} keeps {' + '.join(kinds)} KV in different layers, and the "
                    "built-in engines allocate one kind for every layer")
        if kinds[0] in ("chunked", "state"):
            return f"{self.name} keeps {kinds[0]} KV, which the built-in engines do not allocate"
        return None

    @property
    def kv_bytes_per_token(self) -> int:
        """Per-token KV of every layer group, over all ranks: for attention, 2 x layers x
        kv_heads x head_dim x dtype bytes."""
        return sum(g.bytes_per_token(self.dtype_bytes) for g in self.layer_groups)

    def kv_bytes_per_token_per_rank(self, tp: int = 1) -> int:
        """KV bytes one tensor-parallel rank holds per token: KV heads split across ranks,
        replicated when there are fewer KV heads than ranks, and a latent on every rank."""
        return sum(g.bytes_per_token_per_rank(self.dtype_bytes, tp) for g in self.layer_groups)

    def kv_bytes_per_rank(self, context: int, tp: int = 1) -> int:
        """KV bytes one sequence of ``context`` tokens needs on one rank at most: each group's
        tokens (windowed groups their window's worth) plus fixed per-sequence state."""
        b = self.dtype_bytes
        return sum(g.bytes_per_token_per_rank(b, tp) * g.tokens_kept(context)
                   + g.state_bytes_per_rank(tp) for g in self.layer_groups)

    def _attention_params(self, group: LayerGroup) -> int:
        h = self.hidden_size
        if group.kind == "latent":
            assert self.latent is not None
            return self.latent.params(h, self.num_heads)
        if group.kind == "state":
            assert self.linear is not None
            return self.linear.params(h)
        q, kv = self.num_heads * self.head_dim, group.kv_heads * self.head_dim
        gate = q * h if self.hf_architecture == "Qwen3NextForCausalLM" else 0  # output gate
        return h * q + 2 * h * kv + q * h + gate + (q + 2 * kv if self.qkv_bias else 0)

    def _layers_params(self, active_only: bool) -> int:
        h, moe = self.hidden_size, self.moe
        attn = sum(g.layers * self._attention_params(g) for g in self.layer_groups)
        dense = moe.dense_layers if moe else self.num_layers
        mlp = dense * 3 * h * self.intermediate_size
        if moe:
            mlp += (self.num_layers - dense) * moe.params(h, active_only)
        return attn + mlp + self.num_layers * 2 * h

    @property
    def active_layer_params(self) -> int:
        """Parameters one token's forward pass multiplies in all layers (active experts)."""
        return self._layers_params(active_only=True)

    @property
    def num_params(self) -> int:
        return self._embedding_params + self._layers_params(active_only=False)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass uses, embeddings included (MoE: only the
        routed experts it reaches)."""
        return self._embedding_params + self.active_layer_params

    @property
    def _embedding_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return emb + (0 if self.tie_embeddings else emb) + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        layers = self._layers_params(active_only=False)
        wide = WEIGHT_DTYPE_BYTES[self.weight_dtype or self.dtype]
        return self._embedding_params * self.dtype_bytes + layers * wide

    @property
    def split_window(self) -> int | None:
        """The window of sliding-window layers beside layers that read their whole context
        (their attention is priced apart), or None."""
        windows = [g.window for g in self.layer_groups if g.kind == "sliding"]
        if not windows or len(windows) == len(self.layer_groups):
            return None
        return min(windows)

    def windowed_groups(self, windowed: bool | None) -> tuple[LayerGroup, ...]:
        """The layer groups of a :attr:`split_window` model inside the window (True) or
        outside it (False); every group for None."""
        if windowed is None:
            return self.layer_groups
        return tuple(g for g in self.layer_groups if (g.kind == "sliding") == windowed)

    def attention_flops_per_pair(self, decode: bool = False,
                                 windowed: bool | None = None) -> int:
        """FLOPs of one query x key pair over all layers (those of
        :meth:`windowed_groups`): 4 x heads x head_dim per attention layer (scores and
        values), latent attention's own forms, none for state."""
        total = 0
        for g in self.windowed_groups(windowed):
            if g.kind == "latent":
                assert self.latent is not None
                total += g.layers * self.latent.flops_per_pair(self.num_heads, decode)
            elif g.kind != "state":
                total += 4 * g.layers * self.num_heads * self.head_dim
        return total

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a tensor-parallel degree that splits no head evenly: it must divide the
        attention heads, and divide the KV heads or be a multiple of them (replicated KV
        heads, as vLLM does)."""
        ok_kv = self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0
        if self.linear is not None:  # the state splits by linear-attention heads
            ok_kv = ok_kv and self.linear.k_heads % tp == 0
        if tp >= 1 and self.num_heads % tp == 0 and ok_kv:
            return
        valid = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0
                 and (self.num_kv_heads % d == 0 or d % self.num_kv_heads == 0)]
        raise KvbenchError(
            f"tensor parallelism {tp} cannot split {self.name}'s {self.num_heads} attention "
            f"heads and {self.num_kv_heads} KV heads evenly; use one of "
            f"{', '.join(map(str, valid))}"
        )

    def with_dtype(self, dtype: str) -> ModelPreset:
        if dtype not in DTYPE_BYTES:
            raise KvbenchError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
        return replace(self, dtype=dtype)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        # Records of uniform models keep the fields they always had.
        for name in ("kv_groups", "latent", "linear", "moe", "weight_dtype"):
            if not out[name]:
                del out[name]
        if self.kv_groups:
            out["kv_groups"] = [g.to_json() for g in self.kv_groups]
        out["kv_bytes_per_token"] = self.kv_bytes_per_token
        out["num_params"] = self.num_params
        return out


_QWEN3_NEXT_GDN = GatedDeltaNet(4, 16, 32, 128, 128, 4)
_PRESETS: dict[str, ModelPreset] = {
    # CPU default: small enough for real compute on 2 cores, same architecture as the rest.
    "tiny": ModelPreset(
        name="tiny", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=32, intermediate_size=688, max_position=4096, dtype="float32",
    ),
    # The tiny model with Gemma-2's interleaving: sliding-window (64) and global layers
    # alternate (the hybrid KV policy runs it, on real compute too).
    "tiny-swa": ModelPreset(
        name="tiny-swa", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=32, intermediate_size=688, max_position=4096, dtype="float32",
        kv_groups=(LayerGroup("sliding", 2, 2, 32, window=64), LayerGroup("full", 2, 2, 32)),
    ),
    # The tiny model with DeepSeek-V2's latent attention in every layer (a 64-dim latent and
    # 16 RoPE dims cached per token), dense MLPs.
    "tiny-mla": ModelPreset(
        name="tiny-mla", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8,
        num_kv_heads=8, head_dim=48, intermediate_size=688, max_position=4096, dtype="float32",
        kv_groups=(LayerGroup("latent", 4, latent_dim=64, rope_dim=16),),
        latent=LatentAttention(None, 64, 32, 16, 32),
    ),
    "llama-2-7b": ModelPreset(
        name="llama-2-7b", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, intermediate_size=11008, max_position=4096,
        dtype="float16",
    ),
    "llama-2-13b": ModelPreset(
        name="llama-2-13b", vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40,
        num_kv_heads=40, head_dim=128, intermediate_size=13824, max_position=4096,
        dtype="float16",
    ),
    "llama-3-8b": ModelPreset(
        name="llama-3-8b", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position=8192,
        rope_theta=500000.0,
    ),
    "qwen2.5-7b": ModelPreset(
        name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, intermediate_size=18944, max_position=32768,
        rope_theta=1000000.0, rms_eps=1e-6, qkv_bias=True, hf_architecture="Qwen2ForCausalLM",
    ),
    "deepseek-r1-distill-qwen-7b": ModelPreset(
        name="deepseek-r1-distill-qwen-7b", vocab_size=152064, hidden_size=3584,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, intermediate_size=18944,
        max_position=131072, rope_theta=10000.0, rms_eps=1e-6, qkv_bias=True,
        hf_architecture="Qwen2ForCausalLM",
    ),
    # Mistral-7B v0.3 (vocabulary 32768, RoPE theta 1e6, full attention).
    "mistral-7b": ModelPreset(
        name="mistral-7b", vocab_size=32768, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position=32768,
        rope_theta=1000000.0, hf_architecture="MistralForCausalLM",
    ),
    # Mistral-7B v0.1: vocabulary 32000, RoPE theta 10000, a 4096-token sliding window.
    "mistral-7b-v0.1": ModelPreset(
        name="mistral-7b-v0.1", vocab_size=32000, hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        max_position=32768, rope_theta=10000.0, hf_architecture="MistralForCausalLM",
        sliding_window=4096,
    ),
    "llama-3-70b": ModelPreset(
        name="llama-3-70b", vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, intermediate_size=28672, max_position=8192,
        rope_theta=500000.0,
    ),
    # DeepSeek-V3 (DeepSeek-R1 has the same shapes): latent attention in all 61 layers, the
    # first 3 with dense MLPs, the rest 256 routed experts (8 active) and one shared; weights
    # in FP8 blocks, the latent cache in bfloat16.
    "deepseek-v3": ModelPreset(
        name="deepseek-v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
        num_kv_heads=128, head_dim=192, intermediate_size=18432, max_position=163840,
        rms_eps=1e-6, hf_architecture="DeepseekV3ForCausalLM",
        kv_groups=(LayerGroup("latent", 61, latent_dim=512, rope_dim=64),),
        latent=LatentAttention(1536, 512, 128, 64, 128),
        moe=MixtureOfExperts(256, 8, 2048, shared_intermediate=2048, dense_layers=3),
        weight_dtype="float8",
    ),
    # DeepSeek-V2-Lite: latent attention without a query low-rank projection; 64 routed
    # experts (6 active) and two shared after one dense layer.
    "deepseek-v2-lite": ModelPreset(
        name="deepseek-v2-lite", vocab_size=102400, hidden_size=2048, num_layers=27,
        num_heads=16, num_kv_heads=16, head_dim=192, intermediate_size=10944,
        max_position=163840, rms_eps=1e-6, hf_architecture="DeepseekV2ForCausalLM",
        kv_groups=(LayerGroup("latent", 27, latent_dim=512, rope_dim=64),),
        latent=LatentAttention(None, 512, 128, 64, 128),
        moe=MixtureOfExperts(64, 6, 1408, shared_intermediate=2 * 1408, dense_layers=1),
    ),
    # Gemma-2-9B: sliding-window (4096) and global layers alternate, sliding first.
    "gemma-2-9b": ModelPreset(
        name="gemma-2-9b", vocab_size=256000, hidden_size=3584, num_layers=42, num_heads=16,
        num_kv_heads=8, head_dim=256, intermediate_size=14336, max_position=8192,
        rms_eps=1e-6, tie_embeddings=True, hf_architecture="Gemma2ForCausalLM",
        kv_groups=(LayerGroup("sliding", 21, 8, 256, window=4096), LayerGroup("full", 21, 8, 256)),
    ),
    # Qwen3-Next-80B-A3B: every fourth layer gated full attention, the rest Gated DeltaNet;
    # 512 routed experts (10 active) and a shared one in every layer.
    "qwen3-next-80b-a3b": ModelPreset(
        name="qwen3-next-80b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48,
        num_heads=16, num_kv_heads=2, head_dim=256, intermediate_size=5120,
        max_position=262144, rope_theta=10000000.0, rms_eps=1e-6,
        hf_architecture="Qwen3NextForCausalLM",
        kv_groups=(LayerGroup("state", 36, state_bytes=_QWEN3_NEXT_GDN.state_bytes(2)),
                   LayerGroup("full", 12, 2, 256)),
        linear=_QWEN3_NEXT_GDN,
        moe=MixtureOfExperts(512, 10, 512, shared_intermediate=512),
    ),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def get_preset(name: str) -> ModelPreset:
    try:
        return _PRESETS[name]
    except KeyError:
        raise KvbenchError(
            f"unknown model preset {name!r}; {did_you_mean(name, _PRESETS)}valid presets: "
            f"{', '.join(preset_names())}"
        ) from None
