"""A Llama-style decoder (Llama 2/3, Mistral, Qwen2 shapes) over a flat varlen token batch.

One forward serves any mix of prefill chunks and decodes: tokens of all scheduled sequences
are concatenated, each carries its own position (so chunked prefill and recompute after
preemption rotate exactly as a one-shot prefill would), K/V go to the slots the KV manager
chose, and attention reads each sequence's KV through the kernel backend. Module and
parameter names follow Hugging Face's ``LlamaForCausalLM`` so checkpoints load by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvbench.engines.builtin.torch_device import TORCH_DTYPES
from kvbench.engines.model.presets import ModelPreset
from kvbench.kernels.backend import KernelBackend
from kvbench.kernels.layouts import KVLayout


@dataclass(slots=True)
class AttentionBatch:
    """Where this step's tokens go in the KV pool and what each sequence attends to.

    ``slot_mapping`` ``[T]`` int64; ``cu_seqlens_q`` ``[B + 1]`` int32; ``context_lens``
    ``[B]`` int32 (cached + new tokens); ``layout`` where each sequence's KV lies (block
    tables, extents, ...) and so which kernel reads it; ``plan`` the kernels' plan of this
    batch (``KVLayout.plan``), made once and used by every layer (None: each call plans). See
    :mod:`kvbench.kernels.reference` for the exact semantics.
    """

    slot_mapping: Tensor
    cu_seqlens_q: Tensor
    context_lens: Tensor
    layout: KVLayout
    plan: Any = None


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on the current device: every parameter is filled right after (seeded
    # random or a checkpoint), so a default init would be wasted work on a large model.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _matrix(rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised ``[rows, cols]`` weight of ``F.linear`` (out x in features). On the
    CPU in float32 it is stored column-major, the transpose of a contiguous ``[cols, rows]``:
    where the model's products fall back to ``F.linear`` (no oneDNN, see :func:`pack`),
    ``x @ W^T`` is then MKL's sgemm of two row-major matrices, faster than the transposed
    product over a row-major ``W`` for a decode step's few rows and as fast for long prefill
    chunks. Elsewhere (GPUs, half precision) row-major, as checkpoints store it.
    Values are filled in place (``copy_``), whatever the layout."""
    if torch.get_default_device().type == "cpu" and dtype == torch.float32:
        return torch.empty(cols, rows, dtype=dtype).t()
    return torch.empty(rows, cols, dtype=dtype)


def pack(weight: Tensor) -> Tensor | None:
    """``weight`` (out x in features) copied into oneDNN's blocked layout for :func:`linear`,
    on the CPU in float32 where torch has oneDNN; else None (``F.linear`` serves). oneDNN's
    kernel over a weight packed once (what vLLM's CPU backend runs) is faster than MKL's,
    which picks slower code paths on CPUs other than Intel's, and each row's result does not
    depend on how many rows the batch has. The copy costs the weight's bytes again; the
    parameter keeps the checkpoint's values (state dicts, tied heads)."""
    if not packs(weight.device, weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`pack` packs weights of ``dtype`` on ``device``."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def linear(x: Tensor, weight: Tensor, packed: Tensor | None, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` (``pack(weight)``) when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _linear_param(out_features: int, in_features: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(_matrix(out_features, in_features, dtype), requires_grad=False)


def _fused(*rows: int, cols: int | None, dtype: torch.dtype) -> tuple[Tensor, list[nn.Parameter]]:
    """One uninitialised tensor of ``sum(rows)`` rows (of ``cols`` columns, laid out as
    :func:`_matrix`; a vector without) and parameters that are its consecutive row ranges,
    views of its storage: each is a parameter of its own (a checkpoint's tensor by name,
    counted once), and one matmul over the whole tensor computes all of them. The model is
    built in place and never moved, so the views stay views."""
    whole = (torch.empty(sum(rows), dtype=dtype) if cols is None
             else _matrix(sum(rows), cols, dtype))
    return whole, [nn.Parameter(part, requires_grad=False) for part in whole.split(list(rows))]


class Linear(nn.Module):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
        weight: nn.Parameter | None = None, bias_param: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.weight = _linear_param(out_features, in_features, dtype) if weight is None else weight
        self.bias = None
        if bias:
            self.bias = _param(out_features, dtype=dtype) if bias_param is None else bias_param

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, dim, dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32, scale in the model dtype (Hugging Face's order). Written out,
        # these are F.rms_norm's own CPU ops (the same values, bit for bit), without its
        # wrapper's overhead, which is large on a prefill step's many rows.
        if x.dtype == torch.float32:
            return _normalised(x, self.eps).mul_(self.weight)
        return self.weight * _normalised(x.float(), self.eps).to(x.dtype)


def _normalised(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin ``[T, 1, head_dim // 2]`` float32 for explicit per-token positions."""
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``[T, H, D]`` by half-dimension pairs (the Hugging Face Llama convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, preset: ModelPreset, kernels: KernelBackend,
                 window: int | None = None) -> None:
        super().__init__()
        self.num_heads = preset.num_heads
        self.num_kv_heads = preset.num_kv_heads
        self.head_dim = preset.head_dim
        self.scale = preset.head_dim**-0.5
        self.window = window
        self.kernels = kernels
        q_dim, kv_dim = preset.num_heads * preset.head_dim, preset.num_kv_heads * preset.head_dim
        h, bias, dtype = preset.hidden_size, preset.qkv_bias, _dtype(preset)
        self._split = (q_dim, kv_dim, kv_dim)
        # q, k and v in one matmul (as vLLM's QKVParallelLinear), their weights named apart.
        self.qkv_weight, (wq, wk, wv) = _fused(*self._split, cols=h, dtype=dtype)
        self.qkv_bias, (bq, bk, bv) = _fused(*self._split, cols=None, dtype=dtype) if bias else (
            None, (None, None, None))
        self.q_proj = Linear(h, q_dim, bias, dtype, wq, bq)
        self.k_proj = Linear(h, kv_dim, bias, dtype, wk, bk)
        self.v_proj = Linear(h, kv_dim, bias, dtype, wv, bv)
        self.o_proj = Linear(q_dim, h, False, dtype)
        self.qkv_packed: Tensor | None = None
        self.o_packed: Tensor | None = None

    def pack(self) -> None:
        self.qkv_packed, self.o_packed = pack(self.qkv_weight), pack(self.o_proj.weight)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, batch: AttentionBatch
    ) -> Tensor:
        """``x`` ``[T, hidden]``; ``kv`` this layer's ``[2, num_slots, kv_heads, head_dim]``."""
        t, d, hq = x.shape[0], self.head_dim, self.num_heads
        qkv = linear(x, self.qkv_weight, self.qkv_packed, self.qkv_bias)
        # q and k rotated in one pass over their heads side by side (the same per-element
        # operations as one at a time), then taken apart as views.
        qk = apply_rope(qkv[:, : self._split[0] + self._split[1]].view(t, -1, d), cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, self._split[0] + self._split[1] :]
        if not isinstance(kv, Tensor):  # a pool of several page classes (ClassPools)
            o = kv.store_attend(self.kernels, q, k, v.view(t, self.num_kv_heads, d), self.scale)
            return linear(o.reshape(t, self.num_heads * d), self.o_proj.weight, self.o_packed)
        k_cache, v_cache = kv[0], kv[1]
        self.kernels.store_kv(k_cache, v_cache, k, v.view(t, self.num_kv_heads, d),
                              batch.slot_mapping)
        o = batch.layout.attend(
            self.kernels, q, k_cache, v_cache, batch.context_lens, batch.cu_seqlens_q,
            self.scale, plan=batch.plan, window=self.window,
        )
        return linear(o.reshape(t, self.num_heads * d), self.o_proj.weight, self.o_packed)


class LatentAttentionLayer(nn.Module):
    """Multi-head latent attention (DeepSeek-V2's, queries projected directly), every query
    in the absorbed form: each head's query is folded through its key up-projection onto
    the latent, so attention is multi-query over what the cache keeps per token, the
    normalised latent and the rotated RoPE key side by side, read by the kernels as keys and
    as values (the RoPE part of the output is dropped); each head's value up-projection then
    maps its output back. The same scores as the decompressed form, without materialising
    per-head keys."""

    def __init__(self, preset: ModelPreset, kernels: KernelBackend) -> None:
        super().__init__()
        la = preset.latent
        assert la is not None
        h, heads, dtype = preset.hidden_size, preset.num_heads, _dtype(preset)
        self.num_heads, self.kernels, self.window = heads, kernels, None
        self.nope, self.rope, self.rank, self.v_dim = (la.qk_nope_dim, la.qk_rope_dim,
                                                       la.kv_lora_rank, la.v_head_dim)
        self.scale = (self.nope + self.rope) ** -0.5
        self.q_proj = Linear(h, heads * (self.nope + self.rope), False, dtype)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, False, dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, preset.rms_eps, dtype)
        self.kv_b_proj = Linear(self.rank, heads * (self.nope + self.v_dim), False, dtype)
        self.o_proj = Linear(heads * self.v_dim, h, False, dtype)
        self.qkv_packed: Tensor | None = None
        self.o_packed: Tensor | None = None

    def pack(self) -> None:
        self.o_packed = pack(self.o_proj.weight)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, batch: AttentionBatch
    ) -> Tensor:
        """``kv`` this layer's ``[1, num_slots, 1, latent + rope]``."""
        t, heads, nope, rank = x.shape[0], self.num_heads, self.nope, self.rank
        q = F.linear(x, self.q_proj.weight).view(t, heads, nope + self.rope)
        latent = F.linear(x, self.kv_a_proj_with_mqa.weight)
        entry = torch.cat((self.kv_a_layernorm.forward(latent[:, :rank])[:, None],
                           apply_rope(latent[:, None, rank:], cos, sin)), dim=-1)
        cache = kv[0]
        self.kernels.store_kv(cache, cache, entry, entry, batch.slot_mapping)
        w = self.kv_b_proj.weight.unflatten(0, (heads, nope + self.v_dim))
        query = torch.cat((torch.einsum("thn,hnr->thr", q[..., :nope], w[:, :nope]),
                           apply_rope(q[..., nope:], cos, sin)), dim=-1)
        o = batch.layout.attend(
            self.kernels, query, cache, cache, batch.context_lens, batch.cu_seqlens_q,
            self.scale, plan=batch.plan, window=None,
        )
        out = torch.einsum("thr,hvr->thv", o[..., :rank], w[:, nope:])
        return linear(out.reshape(t, heads * self.v_dim), self.o_proj.weight, self.o_packed)


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, preset: ModelPreset) -> None:
        super().__init__()
        h, inter, dtype = preset.hidden_size, preset.intermediate_size, _dtype(preset)
        self.inter = inter
        # gate and up in one matmul (as vLLM's MergedColumnParallelLinear).
        self.gate_up_weight, (wg, wu) = _fused(inter, inter, cols=h, dtype=dtype)
        self.gate_proj = Linear(h, inter, False, dtype, wg)
        self.up_proj = Linear(h, inter, False, dtype, wu)
        self.down_proj = Linear(inter, h, False, dtype)
        self.gate_up_packed: Tensor | None = None
        self.down_packed: Tensor | None = None

    def pack(self) -> None:
        # Half precision runs unpacked (pack gives None), with gate and up apart (below).
        self.gate_up_packed = pack(self.gate_up_weight)
        self.down_packed = pack(self.down_proj.weight)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            # Half precision keeps two matmuls: on the CPU the fused one's peak (measured by
            # tests/test_activation_model.py) exceeds the three [T, intermediate] tensors
            # that the activation model counts.
            return F.linear(
                F.silu(F.linear(x, self.gate_proj.weight)) * F.linear(x, self.up_proj.weight),
                self.down_proj.weight,
            )
        gate, up = linear(x, self.gate_up_weight, self.gate_up_packed).split(self.inter, dim=-1)
        # In place: [T, 2 x intermediate] and one [T, intermediate] at once, as unfused.
        return linear(F.silu(gate).mul_(up), self.down_proj.weight, self.down_packed)


class DecoderLayer(nn.Module):
    def __init__(self, preset: ModelPreset, kernels: KernelBackend,
                 window: int | None = None) -> None:
        super().__init__()
        self.self_attn: Attention | LatentAttentionLayer = (
            Attention(preset, kernels, window) if preset.latent is None
            else LatentAttentionLayer(preset, kernels))
        self.mlp = MLP(preset)
        self.input_layernorm = RMSNorm(preset.hidden_size, preset.rms_eps, _dtype(preset))
        self.post_attention_layernorm = RMSNorm(
            preset.hidden_size, preset.rms_eps, _dtype(preset)
        )

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, batch: AttentionBatch
    ) -> Tensor:
        # The submodules' forwards called directly: a step runs every layer of the model,
        # and nn.Module's call machinery (hooks, none here) is per-call overhead.
        h = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, kv, batch)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class LlamaModel(nn.Module):
    def __init__(self, preset: ModelPreset, kernels: KernelBackend) -> None:
        super().__init__()
        self.embed_tokens = Embedding(preset.vocab_size, preset.hidden_size, _dtype(preset))
        self.layers = nn.ModuleList(DecoderLayer(preset, kernels, window)
                                    for window in preset.layer_windows)
        self.norm = RMSNorm(preset.hidden_size, preset.rms_eps, _dtype(preset))


class LlamaForCausalLM(nn.Module):
    """The decoder in ``preset.dtype``, with parameters allocated uninitialised on the current
    default device (see ``weights.build_model``). With tied embeddings the LM head is the
    embedding matrix itself."""

    def __init__(self, preset: ModelPreset, kernels: KernelBackend) -> None:
        super().__init__()
        self.preset = preset
        self.model = LlamaModel(preset, kernels)
        self.lm_head = (
            None
            if preset.tie_embeddings
            else Linear(preset.hidden_size, preset.vocab_size, False, _dtype(preset))
        )
        self.head_packed: Tensor | None = None

    @property
    def head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def packed_bytes(self) -> int:
        """Bytes of the packed copies of the weights (see :func:`pack`)."""
        packed = [self.head_packed] + [
            t for layer in self.model.layers
            for t in (layer.self_attn.qkv_packed, layer.self_attn.o_packed,
                      layer.mlp.gate_up_packed, layer.mlp.down_packed)
        ]
        return sum(t.nbytes for t in packed if t is not None)

    def pack_weights(self) -> None:
        """Pack the weights of the forward's matmuls for the CPU (see :func:`pack`); call
        once the weights are final (packed copies do not follow later changes)."""
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        self.head_packed = pack(self.head_weight)

    def embed(self, token_ids: Tensor) -> Tensor:
        """``[T]`` int64 -> ``[T, hidden]``; callers overwrite image/audio rows afterwards."""
        return self.model.embed_tokens(token_ids)

    def forward(
        self,
        hidden: Tensor,
        positions: Tensor,
        batch: AttentionBatch,
        kv_pool: Tensor,
        logits_rows: Tensor,
        layers: list[tuple[Tensor, AttentionBatch]] | None = None,
    ) -> Tensor:
        """Run every layer over ``hidden`` ``[T, hidden]`` at ``positions`` ``[T]``, storing
        K/V into ``kv_pool`` ``[num_layers, 2, num_slots, kv_heads, head_dim]`` (or, with
        ``layers``, each layer into its own cache and slots); return float32 logits
        ``[N, vocab]`` for rows ``logits_rows`` ``[N]`` only."""
        latent = self.preset.latent
        rope = self.preset.head_dim if latent is None else latent.qk_rope_dim
        cos, sin = rope_cos_sin(positions, rope, self.preset.rope_theta)
        for i, layer in enumerate(self.model.layers):
            kv, layer_batch = (kv_pool[i], batch) if layers is None else layers[i]
            hidden = layer.forward(hidden, cos, sin, kv, layer_batch)
        last = self.model.norm.forward(hidden[logits_rows])
        return linear(last, self.head_weight, self.head_packed).float()


def _dtype(preset: ModelPreset) -> torch.dtype:
    return TORCH_DTYPES[preset.dtype]


def greedy(logits: Tensor) -> Tensor:
    """Greedy sampling: the first highest-scoring token of each row."""
    return logits.argmax(dim=-1)
