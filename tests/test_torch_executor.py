"""The torch executor over stand-in KV managers: layouts, chunking, copies, encoders, errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from model_driver import SMALL

from kvbench.engines.builtin.executor import ScheduledBatch, ScheduledSeq
from kvbench.engines.builtin.torch_executor import TorchExecutor
from kvbench.engines.sequence import Sequence
from kvbench.errors import KvbenchError
from kvbench.kernels.layouts import BlockTables, Extents
from kvbench.kernels.slot_copy import SlotCopy
from kvbench.workloads.modalities import audio_token_count, image_token_count
from kvbench.workloads.model import Request, Segment


class PagedStub:
    """Blocks from a shuffled free list, grown on demand (only what the executor reads)."""

    def __init__(self, num_blocks: int, block_size: int = 4, seed: int = 0) -> None:
        self.block_size = block_size
        self.capacity_tokens = num_blocks * block_size
        self.bytes_per_token = SMALL.kv_bytes_per_token
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.tables: dict[int, list[int]] = {}

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> BlockTables:
        width = max(len(self.tables[s.seq_id]) for s in seqs)
        tables = [self.tables[s.seq_id] + [0] * (width - len(self.tables[s.seq_id])) for s in seqs]
        return BlockTables(np.array(tables, dtype=np.int32), self.block_size)

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        table = self.tables.setdefault(seq.seq_id, [])
        while len(table) * self.block_size < end:
            table.append(int(self.free.pop()))
        pos = np.arange(start, end)
        return np.asarray(table)[pos // self.block_size] * self.block_size + pos % self.block_size


class ContiguousStub:
    """Fixed-size extents, placed back to front; ``move`` relocates one like compaction."""

    def __init__(self, num_seqs: int, extent: int = 128) -> None:
        self.capacity_tokens = num_seqs * extent + 8
        self.bytes_per_token = SMALL.kv_bytes_per_token
        self.extent_len = extent
        self.starts = {i: 8 + (num_seqs - 1 - i) * extent for i in range(num_seqs)}

    def attention_layout(self, seqs: list[Sequence], context_lens: np.ndarray) -> Extents:
        return Extents(np.array([self.starts[s.seq_id] for s in seqs], dtype=np.int64))

    def slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        return self.starts[seq.seq_id] + np.arange(start, end)

    def move(self, seq_id: int, dst: int, num_tokens: int) -> SlotCopy:
        copy = SlotCopy(self.starts[seq_id], dst, num_tokens)
        self.starts[seq_id] = dst
        return copy


def make_seq(seq_id: int, segments: tuple[Segment, ...], output: int = 6) -> Sequence:
    req = Request(f"r{seq_id}", 0.0, segments, output)
    return Sequence(seq_id, req, req.prompt_token_ids(SMALL.vocab_size))


def text(n: int, key: str) -> tuple[Segment, ...]:
    return (Segment("text", n, key),)


def generate(executor, kv, seqs, chunk: int = 10_000, on_step=None) -> list[list[int]]:
    """A minimal scheduler: every unfinished sequence gets up to ``chunk`` new tokens a step,
    all in one batch."""
    step = 0
    while not all(s.is_finished for s in seqs):
        items = []
        for s in seqs:
            if s.is_finished:
                continue
            n = min(chunk, s.num_tokens - s.num_computed_tokens)
            sample = s.num_computed_tokens + n == s.num_tokens
            items.append(ScheduledSeq(s, s.num_computed_tokens, n, sample))
        batch = ScheduledBatch(items, on_step(step) if on_step else [])
        sampled = iter(executor.execute(batch, kv))
        for it in items:
            it.seq.num_computed_tokens += it.num_tokens
            if it.sample:
                it.seq.output_ids.append(next(sampled))
        step += 1
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def executor() -> TorchExecutor:
    return TorchExecutor(SMALL, seed=3)


def bound(executor: TorchExecutor, kv) -> TorchExecutor:
    executor.bind(kv)
    return executor


MIXED = [
    text(37, "p/a"),
    (Segment("text", 5, "p/b"), Segment("image", 64, "img/1", 224, 224, rule="qwen2-vl"),
     Segment("text", 9, "p/c")),
    (Segment("audio", 25, "aud/1", seconds=0.5), Segment("text", 3, "p/d")),
    text(12, "p/e"),
]


def test_paged_contiguous_and_chunking_give_identical_tokens(executor):
    kv = PagedStub(64)
    paged = generate(bound(executor, kv), kv, [make_seq(i, s) for i, s in enumerate(MIXED)])
    assert len({t for out in paged for t in out}) > 3
    kv = ContiguousStub(len(MIXED))
    contiguous = generate(bound(executor, kv), kv, [make_seq(i, s) for i, s in enumerate(MIXED)])
    assert contiguous == paged
    kv = PagedStub(64, block_size=16, seed=1)
    chunked = generate(bound(executor, kv), kv, [make_seq(i, s) for i, s in enumerate(MIXED)],
                       chunk=8)
    assert chunked == paged


def test_multimodal_rows_use_encoder_outputs(executor):
    """Replacing the placeholder ids of an image must change what the model generates."""
    seg = Segment("image", 64, "img/2", 224, 224, rule="qwen2-vl")
    other = Segment("image", 64, "img/3", 224, 224, rule="qwen2-vl")
    kv = PagedStub(64)
    a = generate(bound(executor, kv), kv, [make_seq(0, (seg,), 8), make_seq(1, (other,), 8)])
    assert a[0] != a[1]
    assert executor.encoder_cache_bytes() >= 2 * 64 * SMALL.hidden_size * 4


def test_copies_move_kv_before_compute(executor):
    """A compaction that slides an extent mid-generation changes no token."""
    seqs = [make_seq(i, text(20, f"c/{i}"), output=8) for i in range(2)]
    kv = ContiguousStub(2)
    want = generate(bound(executor, kv), kv, seqs)

    seqs = [make_seq(i, text(20, f"c/{i}"), output=8) for i in range(2)]
    kv = ContiguousStub(2)

    def on_step(step: int) -> list[SlotCopy]:
        # After prefill (step 0), slide sequence 0 left over its own old range.
        return [kv.move(0, kv.starts[0] - 5, seqs[0].num_computed_tokens)] if step == 3 else []

    assert generate(bound(executor, kv), kv, seqs, on_step=on_step) == want


def test_copies_without_items_are_applied(executor):
    kv = ContiguousStub(1, extent=16)
    bound(executor, kv)
    executor._pool[:, :, 8:10] = 1.0
    assert executor.execute(ScheduledBatch([], [SlotCopy(8, 0, 2)]), kv) == []
    assert executor._pool[:, :, 0:2].eq(1.0).all()


def test_pool_is_one_exact_allocation(executor):
    kv = PagedStub(10)
    bound(executor, kv)
    assert executor.kv_pool_bytes == kv.capacity_tokens * SMALL.kv_bytes_per_token
    desc = executor.describe()
    json.dumps(desc)
    assert desc["kv_pool_bytes"] == executor.kv_pool_bytes
    assert desc["packed_weight_bytes"] == executor.model.packed_bytes()
    assert desc["weights"] == "random(seed=3)" and desc["attention"] == "reference"
    assert desc["device"] == "cpu" and desc["dtype"] == "float32"


def test_bind_rejects_mismatched_kv_bytes(executor):
    kv = PagedStub(4)
    kv.bytes_per_token //= 2
    with pytest.raises(KvbenchError, match="bytes/token"):
        executor.bind(kv)


def test_pool_larger_than_memory_is_a_clear_error(executor):
    kv = PagedStub(4)
    kv.capacity_tokens = 2**50
    with pytest.raises(KvbenchError, match=r"cannot allocate KV pool .* bytes\) asked, .* free"):
        executor.bind(kv)


def test_segment_disagreeing_with_its_rule(executor):
    bad = (Segment("image", 60, "img/bad", 224, 224, rule="qwen2-vl"),)
    kv = PagedStub(32)
    with pytest.raises(KvbenchError, match="gives 64 tokens but the segment has 60"):
        generate(bound(executor, kv), kv, [make_seq(0, bad)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda():
    with pytest.raises(KvbenchError, match=r"--device cpu.*sim:"):
        TorchExecutor(SMALL, device="cuda")


def test_unknown_attention_backend():
    with pytest.raises(KvbenchError, match=r"unknown attention backend .flash.; valid"):
        TorchExecutor(SMALL, attention="flash")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_layouts_agree():
    gpu = TorchExecutor(SMALL, device="cuda", seed=3)
    kv = PagedStub(64)
    paged = generate(bound(gpu, kv), kv, [make_seq(i, s) for i, s in enumerate(MIXED)])
    kv = ContiguousStub(len(MIXED))
    contiguous = generate(bound(gpu, kv), kv, [make_seq(i, s) for i, s in enumerate(MIXED)])
    assert paged == contiguous


def test_rules_used_here_match_workload_counts():
    assert image_token_count("qwen2-vl", 224, 224) == 64
    assert audio_token_count(0.5) == 25


def test_one_attention_plan_per_step(executor, monkeypatch):
    """The kernels' host-side plan is made once per step, not once per layer, and every layer
    gets it."""
    from kvbench.kernels import reference

    made, used = [], []
    real_plan, real_attend = reference.plan_paged, reference.paged_attention

    def plan(*args, **kw):
        made.append(real_plan(*args, **kw))
        return made[-1]

    def attend(*args, plan=None, **kw):
        used.append(plan)
        return real_attend(*args, plan=plan, **kw)

    spied = dataclasses.replace(executor.kernels, plan_paged=plan, paged_attention=attend)
    monkeypatch.setattr(executor, "kernels", spied)
    for layer in executor.model.model.layers:
        monkeypatch.setattr(layer.self_attn, "kernels", spied)
    kv = PagedStub(64)
    generate(bound(executor, kv), kv, [make_seq(i, text(9 + 5 * i, f"p/{i}"), 3) for i in range(3)])
    assert len(made) == 3  # prefill, two decodes
    assert used == [p for p in made for _ in range(SMALL.num_layers)]
