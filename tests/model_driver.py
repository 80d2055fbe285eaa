"""A tiny decoder preset and a driver that runs the model over a hand-made slot layout."""

from __future__ import annotations

import numpy as np
import torch

from kvbench.engines.builtin.torch_device import TORCH_DTYPES
from kvbench.engines.model.llama import AttentionBatch, LlamaForCausalLM, greedy
from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.model.weights import build_model
from kvbench.kernels.backend import get_backend
from kvbench.kernels.layouts import BlockTables, Extents, KVLayout

SMALL = ModelPreset(
    name="small", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=128, max_position=1024, dtype="float32",
)
KERNELS = get_backend("reference")
CPU = torch.device("cpu")


def make_model(preset: ModelPreset = SMALL, seed: int = 0) -> LlamaForCausalLM:
    return build_model(preset, KERNELS, CPU, seed=seed)


class Runner:
    """Drives the model for a few sequences with a hand-made slot layout.

    ``paged``: blocks of 8 slots handed out in shuffled order; ``contiguous``: each sequence
    owns a fixed extent, placed in reverse order.
    """

    BLOCK = 8
    EXTENT = 96

    def __init__(self, model: LlamaForCausalLM, layout: str, num_seqs: int, seed: int = 0):
        p = model.preset
        self.model, self.layout = model, layout
        num_slots = num_seqs * self.EXTENT
        self.pool = torch.zeros(
            p.num_layers, 2, num_slots, p.num_kv_heads, p.head_dim, dtype=TORCH_DTYPES[p.dtype]
        )
        blocks = np.random.default_rng(seed).permutation(num_slots // self.BLOCK)
        per_seq = self.EXTENT // self.BLOCK
        self.tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]
        self.starts = [(num_seqs - 1 - i) * self.EXTENT for i in range(num_seqs)]

    def slots(self, seq: int, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        if self.layout == "paged":
            return self.tables[seq][pos // self.BLOCK] * self.BLOCK + pos % self.BLOCK
        return self.starts[seq] + pos

    def step(self, work: list[tuple[int, np.ndarray, int]]) -> torch.Tensor:
        """``work``: (sequence, token ids, start position) chunks; logits of each chunk's last
        token."""
        spans = [(s, start, start + len(ids)) for s, ids, start in work]
        cu = np.cumsum([0] + [len(ids) for _, ids, _ in work])
        if self.layout == "paged":
            tables = np.stack([self.tables[s] for s, _, _ in spans])
            layout: KVLayout = BlockTables(tables, self.BLOCK)
        else:
            layout = Extents(np.array([self.starts[s] for s, _, _ in spans]))
        batch = AttentionBatch(
            slot_mapping=torch.from_numpy(np.concatenate([self.slots(*span) for span in spans])),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            context_lens=torch.tensor([end for _, _, end in spans], dtype=torch.int32),
            layout=layout.on(torch.device("cpu")),
        )
        ids = torch.from_numpy(np.concatenate([ids for _, ids, _ in work]))
        positions = torch.from_numpy(np.concatenate([np.arange(a, b) for _, a, b in spans]))
        rows = torch.from_numpy(cu[1:] - 1)
        with torch.inference_mode():
            return self.model(self.model.embed(ids), positions, batch, self.pool, rows)

    def generate(
        self, prompts: list[np.ndarray], steps: int, chunk: int | None = None
    ) -> list[list[int]]:
        """Greedy generation for every prompt: prefill (in ``chunk``-token pieces, all
        sequences' chunks batched together), then ``steps`` batched decodes."""
        done = [0] * len(prompts)
        out: list[list[int]] = [[] for _ in prompts]
        while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
            work = []
            for s, p in enumerate(prompts):
                if done[s] < len(p):
                    end = len(p) if chunk is None else min(len(p), done[s] + chunk)
                    work.append((s, p[done[s] : end], done[s]))
                    done[s] = end
            logits = self.step(work)
            for (s, _, _), tok in zip(work, greedy(logits).tolist(), strict=True):
                if done[s] == len(prompts[s]):
                    out[s].append(tok)
        for _ in range(steps - 1):
            work = [
                (s, np.array([out[s][-1]]), len(p) + len(out[s]) - 1)
                for s, p in enumerate(prompts)
            ]
            for s, tok in enumerate(greedy(self.step(work)).tolist()):
                out[s].append(tok)
        return out


def prompts(lengths: list[int], vocab: int = SMALL.vocab_size, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n) for n in lengths]
