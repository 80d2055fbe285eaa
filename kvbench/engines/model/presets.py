"""Model presets: real model shapes, from which KV bytes per token, weight bytes and FLOPs follow.

Shapes are those of the published Hugging Face ``config.json`` files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.units import did_you_mean

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes_per_token_per_rank(self, tp: int = 1) -> int:
        """KV bytes one tensor-parallel rank holds per token: KV heads split across ranks,
        replicated when there are fewer KV heads than ranks."""
        return self.kv_bytes_per_token // min(tp, self.num_kv_heads)

    @property
    def layer_params(self) -> int:
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    @property
    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else emb
        return emb + head + self.num_layers * self.layer_params + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a tensor-parallel degree that splits no head evenly: it must divide the
        attention heads, and divide the KV heads or be a multiple of them (replicated KV
        heads, as vLLM does)."""
        ok_kv = self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0
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
        out["kv_bytes_per_token"] = self.kv_bytes_per_token
        out["num_params"] = self.num_params
        return out


_PRESETS: dict[str, ModelPreset] = {
    # CPU default: small enough for real compute on 2 cores, same architecture as the rest.
    "tiny": ModelPreset(
        name="tiny", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=32, intermediate_size=688, max_position=4096, dtype="float32",
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
