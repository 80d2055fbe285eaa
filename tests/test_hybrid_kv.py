"""KV per layer group in the built-in engine (the hybrid policy): window release, state
slots, prefix hits per group, conservation, and the cost of windowed layers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from helpers import make_workload, run_cli, text_request
from kvbench.engines.base import BatchShape
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.kv.hybrid import HybridKVManager, HybridPolicy
from kvbench.engines.kv.large_pages import LargePages
from kvbench.engines.model.layers import LayerGroup
from kvbench.engines.model.presets import ModelPreset, get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sequence import Sequence
from kvbench.engines.sim.costmodel import CostModel
from kvbench.errors import KvbenchError
from kvbench.results.metrics import summarize
from kvbench.run.clocks import VirtualClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine

GiB = 1 << 30


def _settings(preset: ModelPreset, kv_bytes: int, device: str = "sim:h200",
              batched: int = 2048) -> EngineSettings:
    return EngineSettings(preset=preset, device=parse_device(device), kv_bytes=kv_bytes,
                          block_size=16, prefix_caching=True,
                          scheduler=SchedulerConfig(8192, 64, batched, True))


def _manager(preset: ModelPreset, kv_bytes: int, layout: str = "common-page",
             device: str = "sim:h200", batched: int = 2048) -> HybridKVManager:
    policy = HybridPolicy(layout=layout)
    config = engine_config("hybrid", policy, _settings(preset, kv_bytes, device, batched))
    return policy.manager(config)


def _seq(seq_id: int, ids: np.ndarray, output: int = 4) -> Sequence:
    return Sequence(seq_id, text_request(f"r{seq_id}", len(ids), output), ids)


def _prefill(kv: HybridKVManager, seq: Sequence, chunk: int) -> None:
    """Admit ``seq`` with what the cache holds and compute its prompt in ``chunk``s."""
    cached = kv.lookup_prefix(seq)
    first = min(chunk, seq.num_prompt_tokens - cached)
    assert kv.allocate(seq, cached, first)
    seq.num_computed_tokens += first
    kv.commit(seq)
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        n = min(chunk, seq.num_prompt_tokens - seq.num_computed_tokens)
        assert kv.grow(seq, n)
        seq.num_computed_tokens += n
        kv.commit(seq)


def _mixed(window: int = 64) -> ModelPreset:
    tiny = get_preset("tiny")
    return replace(tiny, name="mixed", num_layers=4, kv_groups=(
        LayerGroup("sliding", 2, 2, 32, window=window), LayerGroup("full", 2, 2, 32)))


def test_a_window_group_keeps_only_its_window_and_its_blocks_stay_findable():
    kv = _manager(_mixed(), 1 << 22)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, 300)
    a = _seq(0, ids)
    _prefill(kv, a, 128)
    sliding, full = kv.stats().groups.values()
    # The window of 64 spans at most 5 blocks of 16; the full group holds all 19.
    assert sliding["reserved_bytes"] == 5 * kv.groups[0].block_bytes
    assert full["reserved_bytes"] == 19 * kv.groups[1].block_bytes
    assert sliding["used_bytes"] == (300 - 14 * 16) * kv.groups[0].token_bytes
    a.output_ids = [1] * a.request.output_tokens  # finished
    kv.free(a)
    stats = kv.stats()
    assert stats.reserved_bytes == 0 and stats.used_bytes == 0
    # Released window blocks were cached before they left: the same prompt hits all of it.
    b = _seq(1, ids)
    assert kv.lookup_prefix(b) == 18 * 16


def test_a_state_group_hits_only_at_its_snapshots():
    preset = get_preset("qwen3-next-80b-a3b")
    kv = _manager(preset, 16 * GiB, device="sim:h200x2", batched=4096)
    assert kv.block == 544 and kv.plan.state_every == 1
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 100_000, 2000)
    a = _seq(0, ids)
    _prefill(kv, a, 4096)  # one chunk: one snapshot, at 3 x 544 tokens
    states = [g for g in kv.stats().groups.values() if g["kind"] == "state"]
    assert len(states) == 3 and all(g["snapshots"] == 1 for g in states)
    # Every running sequence holds one state block per state group.
    assert all(g["reserved_bytes"] == g["block_bytes"] for g in states)
    b = _seq(1, np.concatenate([ids[:1200], rng.integers(0, 100_000, 800)]))
    # The full-attention group holds 2 blocks of the shared 1,200 tokens, but no state
    # snapshot lies at 544 or 1,088 tokens: the request hits nothing.
    assert kv.lookup_prefix(b) == 0
    _prefill(kv, b, 4096)
    groups = kv.stats().groups
    assert groups["full3"]["hit_tokens"] == 2 * 544
    assert groups["state0"]["hit_tokens"] == 0
    # Computed in 512-token chunks, a prompt passes boundaries at chunk ends: snapshots
    # at 544 and 1,088 tokens let the next request hit there.
    c = _seq(2, rng.integers(0, 100_000, 2000))
    _prefill(kv, c, 512)
    d = _seq(3, np.concatenate([c.prompt_ids[:1200], rng.integers(0, 100_000, 500)]))
    assert kv.lookup_prefix(d) == 2 * 544


@pytest.mark.parametrize("model, device, layout", [
    ("gemma-2-9b", "sim:h200", "common-page"), ("gemma-2-9b", "sim:h200", "per-group"),
    ("gemma-2-9b", "sim:h200", "uniform"), ("qwen3-next-80b-a3b", "sim:h200x2", "common-page"),
    ("qwen3-next-80b-a3b", "sim:h200x2", "per-group")])
def test_mixed_models_run_and_return_every_block(model, device, layout):
    preset = get_preset(model)
    opts = _settings(preset, 3 * GiB, device)
    section = HybridPolicy(layout=layout)
    shared = "s" * 8
    wl = make_workload([
        text_request(f"r{i}", 1500 + 301 * (i % 7), 40 + 9 * (i % 4), arrival=0.05 * i,
                     key=shared if i % 2 else None)
        for i in range(60)])
    engine = build_engine(engine_config("h", section, opts))
    run = run_engine(engine, wl, VirtualClock(CostModel(preset, opts.device.hardware,
                                                        opts.device.tp)))
    assert run.status == "ok", run.error
    assert all(t.output_tokens_emitted == t.request.output_tokens
               for t in run.timings.values())
    last = run.last_kv
    assert last is not None and last.reserved_bytes == 0 and last.used_bytes == 0
    assert all(g["reserved_bytes"] == 0 and g["used_bytes"] == 0
               for g in last.groups.values())
    s = summarize(run)
    assert 0 < s["peak_kv_used_bytes"] <= s["peak_kv_reserved_bytes"] <= 3 * GiB
    assert s["prefix_hit_rate"] > 0
    kinds = {g["kind"] for g in last.groups.values()}
    for kind in kinds:
        reserved = s[f"peak_kv_{kind}_group_reserved_bytes"]
        assert 0 < s[f"peak_kv_{kind}_group_used_bytes"] <= reserved
        assert s["prefix_hit_rate"] <= s[f"prefix_hit_rate_{kind}_group"] <= 1
    assert sum(s[f"peak_kv_{k}_group_reserved_bytes"] for k in kinds) >= \
        s["peak_kv_reserved_bytes"]
    # Each group alone could serve at least what the request hit.
    assert all(g["hit_tokens"] >= last.prefix_hit_tokens for g in last.groups.values())


def test_one_full_group_hits_and_times_as_paged_does():
    preset = get_preset("llama-3-8b")
    opts = _settings(preset, 2 * GiB, "sim:a100-80gb")
    wl = make_workload([
        text_request(f"r{i}", 700 + 53 * (i % 9), 30 + 11 * (i % 3), arrival=0.02 * i,
                     key="common" if i % 3 else None) for i in range(40)])
    runs = {}
    for name in ("paged", "hybrid"):
        engine = build_engine(engine_config(name, NAMED_ENGINES[name], opts))
        clock = VirtualClock(CostModel(preset, opts.device.hardware, opts.device.tp))
        runs[name] = run_engine(engine, wl, clock)
    paged, hybrid = runs["paged"], runs["hybrid"]
    assert hybrid.last_kv.prefix_hit_tokens == paged.last_kv.prefix_hit_tokens > 0
    assert {k: t.finish_s for k, t in hybrid.timings.items()} == \
        {k: t.finish_s for k, t in paged.timings.items()}


def test_windowed_layers_read_and_attend_within_their_window():
    gemma = get_preset("gemma-2-9b")
    cost = CostModel(gemma, parse_device("sim:h200").hardware)
    ctx = 8192
    shape = BatchShape(num_seqs=1, decode_tokens=1, context_tokens=ctx, attn_pairs=ctx,
                       decode_pairs=ctx, window_context_tokens=4096, window_pairs=4096,
                       window_decode_pairs=4096)
    per_layer = 2 * 8 * 256 * 2  # K and V, 8 KV heads of 256, bf16
    assert cost.terms(shape).kv_bytes == 21 * per_layer * (ctx + 1 + 4096 + 1)
    assert cost.terms(shape).attention_flops == 4 * 21 * 16 * 256 * (ctx + 4096)
    # Every other model's step is priced as before: its window counts stay unread.
    llama = CostModel(get_preset("llama-3-8b"), parse_device("sim:h200").hardware)
    assert llama.terms(shape) == llama.terms(replace(shape, window_context_tokens=0,
                                                     window_pairs=0, window_decode_pairs=0))


def test_the_hybrid_policy_refuses_what_it_cannot_run(capsys, tmp_path):
    state = HybridPolicy(layout="uniform")
    with pytest.raises(KvbenchError, match="recurrent state"):
        state.check(engine_config("u", state, _settings(get_preset("qwen3-next-80b-a3b"), GiB,
                                                        "sim:h200x2")))
    policy = HybridPolicy(layout="per-group")
    with pytest.raises(KvbenchError, match="per-group pools are simulated only"):
        policy.check(engine_config("h", policy, _settings(get_preset("tiny-swa"), GiB, "cpu")))
    policy = HybridPolicy()
    with pytest.raises(KvbenchError, match="hybrid KV policy"):
        engine_config("p", NAMED_ENGINES["paged"], _settings(get_preset("gemma-2-9b"), GiB))
    config = engine_config("h", policy, _settings(get_preset("gemma-2-9b"), GiB))
    reason = policy.admission(config)(text_request("n2", 100, 10, n=2))
    assert reason is not None and "n=2" in reason
    code, out = run_cli(["run", "--model", "gemma-2-9b", "--device", "cpu", "--engines",
                         "hybrid", "--out", str(tmp_path / "run"), "--force"], capsys)
    assert code == 2 and "simulated devices only" in out


def test_records_carry_per_group_metrics_and_curves(capsys, tmp_path):
    from kvbench.results.metric_table import CURVE_BY_NAME, METRIC_BY_NAME
    from kvbench.results.schema import load_record

    code, out = run_cli(["run", "quick-sim", "--model", "gemma-2-9b", "--device", "sim:h200",
                         "--engines", "hybrid", "--num-requests", "12", "--out",
                         str(tmp_path), "--force"], capsys)
    assert code == 0, out
    rec = load_record(tmp_path / "hybrid.json")
    for kind in ("sliding", "full"):
        assert rec.summary[f"peak_kv_{kind}_group_reserved_bytes"] > 0
        assert rec.curves[f"kv_{kind}_group_used_bytes"]
    assert "peak_kv_state_group_reserved_bytes" not in rec.summary
    assert not {k for k in rec.summary if "group" in k} - set(METRIC_BY_NAME)
    assert not set(rec.curves) - set(CURVE_BY_NAME)


def _swa_workload():
    from kvbench.workloads.model import Request, Segment

    shared = Segment("text", 40, "shared/system")
    return make_workload([
        Request(f"r{i}", 0.0, (shared, Segment("text", 30 + 23 * i, f"user/{i}")), 24 + 5 * i)
        for i in range(6)])


def _real_digests(section, kv_tokens: int, *, prefix: bool = True, batched: int = 64,
                  preset: str = "tiny-swa", attention: str = "auto") -> dict[str, str]:
    from kvbench.run.clocks import WallClock

    p = get_preset(preset)
    opts = EngineSettings(preset=p, attention=attention, device=parse_device("cpu"),
                          kv_bytes=kv_tokens * p.kv_bytes_per_token, block_size=16,
                          prefix_caching=prefix,
                          scheduler=SchedulerConfig(1024, 8, batched, True))
    engine = build_engine(engine_config("h", section, opts))
    run = run_engine(engine, _swa_workload(), WallClock())
    assert run.status == "ok", run.error
    return {rid: t.output_digest for rid, t in run.timings.items()}


@pytest.mark.parametrize("attention", ["reference", "native"])
def test_interleaved_windows_compute_the_same_tokens_under_every_pool(attention):
    """Real compute of sliding-window and global layers side by side: vLLM's common-page
    pool (windows released, blocks reused) and the uniform one give the same tokens, with
    prefix hits, chunked prefill and preemption; and the windows do change the output."""
    from kvbench.kernels.backend import backend_names

    if attention not in backend_names():
        pytest.skip(f"the {attention} kernels do not build here")
    uniform, common = HybridPolicy(layout="uniform"), HybridPolicy()
    reference = _real_digests(uniform, 4096, prefix=False, batched=1024, attention=attention)
    assert _real_digests(common, 4096, attention=attention) == reference
    # A pool of a few blocks: sequences wait, are preempted and hit cached windows.
    assert _real_digests(common, 320, batched=48, attention=attention) == reference
    assert _real_digests(uniform, 320, batched=48, attention=attention) == reference
    plain = _real_digests(NAMED_ENGINES["paged"], 4096, prefix=False, batched=1024,
                          preset="tiny", attention=attention)
    assert plain != reference


def test_latent_attention_equals_the_decompressed_form():
    """The absorbed form the model computes against per-head keys and values built from the
    latent, as DeepSeek-V2 defines them."""
    import torch

    from kvbench.engines.model.llama import AttentionBatch, rope_cos_sin
    from kvbench.engines.model.weights import build_model
    from kvbench.kernels.backend import get_backend
    from kvbench.kernels.layouts import BlockTables

    preset = get_preset("tiny-mla")
    kernels = get_backend("reference", "cpu")
    layer = build_model(preset, kernels, torch.device("cpu"), seed=3).model.layers[1].self_attn
    t, heads, la = 37, preset.num_heads, preset.latent
    x = torch.randn(t, preset.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(torch.arange(t), la.qk_rope_dim, preset.rope_theta)
    cache = torch.zeros(1, 48, 1, la.kv_lora_rank + la.qk_rope_dim)
    batch = AttentionBatch(torch.arange(t), torch.tensor([0, t], dtype=torch.int32),
                           torch.tensor([t], dtype=torch.int32),
                           BlockTables(np.array([[0, 1, 2]], dtype=np.int32), 16).on("cpu"))
    with torch.inference_mode():
        got = layer.forward(x, cos, sin, cache, batch)
        from kvbench.engines.model.llama import apply_rope

        nope, rope, rank, v_dim = la.qk_nope_dim, la.qk_rope_dim, la.kv_lora_rank, la.v_head_dim
        q = (x @ layer.q_proj.weight.T).view(t, heads, nope + rope)
        q = torch.cat((q[..., :nope], apply_rope(q[..., nope:], cos, sin)), -1)
        kv_a = x @ layer.kv_a_proj_with_mqa.weight.T
        c = layer.kv_a_layernorm.forward(kv_a[:, :rank])
        k_rope = apply_rope(kv_a[:, None, rank:], cos, sin).expand(t, heads, rope)
        kv = (c @ layer.kv_b_proj.weight.T).view(t, heads, nope + v_dim)
        k = torch.cat((kv[..., :nope], k_rope), -1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / (nope + rope) ** 0.5
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., nope:])
        want = o.reshape(t, heads * v_dim) @ layer.o_proj.weight.T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["reference", "native"])
def test_latent_attention_computes_the_same_tokens_under_every_policy(attention):
    from kvbench.kernels.backend import backend_names

    if attention not in backend_names():
        pytest.skip(f"the {attention} kernels do not build here")
    contiguous = NAMED_ENGINES["contiguous-request"]
    reference = _real_digests(contiguous, 4096, prefix=False, batched=1024,
                              preset="tiny-mla", attention=attention)
    for section, kv_tokens, batched in ((NAMED_ENGINES["paged"], 4096, 64),
                                        (NAMED_ENGINES["paged"], 320, 48),
                                        (HybridPolicy(), 320, 48),
                                        (NAMED_ENGINES["segmented"], 2048, 64)):
        assert _real_digests(section, kv_tokens, batched=batched, preset="tiny-mla",
                             attention=attention) == reference, section.label()


def _driver_seq(i: int, prompt: int, output: int, prefix: tuple[str, int] | None) -> Sequence:
    from kvbench.workloads.model import Request, Segment

    segments = [Segment("text", prefix[1], prefix[0])] if prefix else []
    segments.append(Segment("text", prompt, f"own/{i}"))
    request = Request(f"r{i}", 0.0, tuple(segments), output)
    return Sequence(i, request, request.prompt_token_ids(97))


class _GroupDriver:
    """A scheduler stand-in: every computed token writes ``(position * 97 + id) * 8 +
    group`` into its slot of its group's pool, so a slot handed to two sequences or two
    groups, or a bad prefix hit, reads back wrong."""

    def __init__(self, kv: HybridKVManager) -> None:
        self.kv, self.running = kv, []
        self.mem = [np.full(p.num_blocks * kv.block, -1, np.int64) for p in kv.pools]

    def _want(self, seq: Sequence, start: int, end: int, gi: int) -> np.ndarray:
        return (np.arange(start, end) * 97 + seq.token_ids(start, end)) * 8 + gi

    def compute(self, seq: Sequence, n: int) -> None:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        for gi, g in enumerate(self.kv.groups):
            if g.holds_tokens:
                self.mem[g.pool][self.kv.slots(seq, start, end, group=gi)] = self._want(
                    seq, start, end, gi)
        seq.num_computed_tokens = end
        self.kv.commit(seq)
        if end == seq.num_tokens:
            seq.output_ids.append(int(end % 97))
            if seq.is_finished:
                self.kv.free(seq)
                self.running.remove(seq)

    def check(self, chunk_max: int) -> None:
        kv, b = self.kv, self.kv.block
        s = kv.stats()
        assert 0 <= s.used_bytes <= s.reserved_bytes <= s.capacity_bytes
        assert s.reserved_bytes == sum(g["reserved_bytes"] for g in s.groups.values())
        if isinstance(kv.budget, LargePages):
            _check_pages(kv.budget)
        owner: dict[tuple[int, int], int] = {}  # (pool, block) -> the group holding it
        for gi, g in enumerate(kv.groups):
            tables = [kv._seqs[q.seq_id].tables[gi] for q in self.running]
            held = [t.blocks[t.released:] for t in tables]
            blocks = {blk for h in held for blk in h}
            assert len(blocks) == kv._counts[gi].held_blocks
            for blk in blocks:
                assert owner.setdefault((g.pool, blk), gi) == gi, "a block in two groups"
            if not g.holds_tokens:  # one running state each, never shared
                assert all(len(h) == 1 for h in held)
                assert len({h[0] for h in held}) == len(held)
                continue
            if g.kind == "sliding":
                most = -(-(g.window - 1) // b) + 1 + -(-chunk_max // b)
                assert all(len(h) <= most for h in held)
            for q, t in zip(self.running, tables, strict=True):
                first, n = t.released * b, q.num_computed_tokens
                got = self.mem[g.pool][kv.slots(q, first, n, group=gi)]
                assert np.array_equal(got, self._want(q, first, n, gi))


def _check_pages(pages: LargePages) -> None:
    """Every block in use (referenced or cached) lies in a large page its pool owns, and
    the pages' counts are the pools' own."""
    used: dict[int, int] = {}
    for i, (pool, per) in enumerate(zip(pages.pools, pages.per, strict=True)):
        assert pool.num_plain_free == 0  # plain free blocks are kept by page
        for b in range(pool.num_blocks):
            if pool.ref[b] or pool._hash[b] is not None:
                assert used.setdefault(b // per, i) == i, "a large page used by two pools"
    for p in range(len(pages.owner)):
        i = pages.owner[p]
        if i < 0:
            assert p not in used and p in pages.free_pages
            continue
        pool, per = pages.pools[i], pages.per[i]
        blocks = range(p * per, (p + 1) * per)
        refd = sum(1 for b in blocks if pool.ref[b])
        cached = sum(1 for b in blocks if not pool.ref[b] and pool._hash[b] is not None)
        assert (pages.refd[p], pages.cached[p]) == (refd, cached)
        assert sorted(pages.plain[p]) == [b for b in blocks if not pool.ref[b]
                                          and pool._hash[b] is None]
        assert (p in pages.idle) == (refd == 0) and (refd or cached)
    assert sum(o >= 0 for o in pages.owner) + len(pages.free_pages) == len(pages.owner)
    assert pages.reserved_bytes() <= pages.budget


@settings(max_examples=100, deadline=None)
@given(data=st.data(), model=st.sampled_from(["swa", "state"]),
       layout=st.sampled_from(["common-page", "per-group", "uniform"]),
       blocks=st.integers(8, 30))
def test_random_operations_keep_every_group_consistent(data, model, layout, blocks):
    """Arrivals with shared prefixes, chunked admissions, growth with preemption on
    failure, preemptions: every group's blocks are counted once, window groups hold no
    more than their window, states are one block a running sequence, no two sequences
    share a written slot, and everything returns once they are gone."""
    if model == "swa":
        preset = replace(_mixed(window=20), name="swa")
        per_block = 4 * preset.kv_bytes_per_token
    else:
        assume(layout != "uniform")  # no uniform layout holds recurrent state
        preset = get_preset("qwen3-next-80b-a3b")
        # Per-group pools carve pages of two states (201 attention blocks): give them four.
        per_block = 544 * 12 * 2 * 2 * 256 * 2 * (3 if layout == "per-group" else 1)
    policy = HybridPolicy(layout=layout)
    opts = replace(_settings(preset, blocks * per_block, "sim:h200x2" if model == "state"
                             else "sim:h200"), block_size=4 if model == "swa" else 16)
    kv = policy.manager(engine_config("h", policy, opts))
    scale = 4 if model == "swa" else 544
    chunk_max = 3 * scale
    d, waiting = _GroupDriver(kv), []
    ops = ["new", "admit", "admit", "step", "step", "step", "step", "step", "preempt"]
    for i in range(data.draw(st.integers(10, 90), label="ops")):
        op = data.draw(st.sampled_from(ops))
        if op == "new":
            prefix = data.draw(st.sampled_from("ab")), data.draw(st.integers(1, 4 * scale))
            seq = _driver_seq(i, data.draw(st.integers(1, 2 * scale)),
                              data.draw(st.integers(1, scale)), prefix)
            if kv.never_fits(seq.request) is None:
                waiting.append(seq)
        elif op == "admit" and waiting:
            seq = waiting[0]
            cached = kv.lookup_prefix(seq)
            n = min(data.draw(st.integers(1, chunk_max)), seq.num_tokens - cached)
            if kv.allocate(seq, cached, n):
                waiting.pop(0)
                d.running.append(seq)
                seq.num_computed_tokens = cached
                d.compute(seq, n)
        elif op == "step" and d.running:
            seq = data.draw(st.sampled_from(d.running))
            n = min(data.draw(st.integers(1, chunk_max)), seq.num_tokens - seq.num_computed_tokens)
            if kv.grow(seq, n):
                d.compute(seq, n)
            else:
                victim = d.running.pop()
                kv.free(victim)
                victim.num_computed_tokens = 0
                waiting.append(victim)
        elif op == "preempt" and d.running:
            seq = data.draw(st.sampled_from(d.running))
            d.running.remove(seq)
            kv.free(seq)
            seq.num_computed_tokens = 0
            waiting.append(seq)
        d.check(chunk_max)
    for seq in list(d.running):
        d.running.remove(seq)
        kv.free(seq)
    d.check(chunk_max)
    s = kv.stats()
    assert s.reserved_bytes == s.used_bytes == 0
    assert all(c.held_blocks == c.written_tokens == 0 for c in kv._counts)
    assert all(max(p.ref) == 0 for p in kv.pools)


def test_per_group_pools_carve_large_pages_of_the_least_common_multiple() -> None:
    """Qwen3-Next at TP2, 16-token blocks: a state is 39,518,208 bytes and an attention
    block 393,216, so a large page (their least common multiple, 79,036,416 bytes) holds
    two states or 201 blocks; a budget of fewer pages than pools is refused."""
    preset = get_preset("qwen3-next-80b-a3b")
    kv = _manager(preset, 10 * 79_036_416 + 5, "per-group", "sim:h200x2")
    assert kv.plan.page_bytes == 79_036_416 and kv.budget.budget == 10 * 79_036_416
    assert [p.num_blocks for p in kv.pools] == [20, 2010]
    with pytest.raises(KvbenchError, match="fewer than 2 per-group pages of 79036416 bytes"):
        _manager(preset, 79_036_416, "per-group", "sim:h200x2")


def test_memory_stranded_in_other_groups_pages_shows_as_fragmentation():
    """Qwen3-Next in 1 GiB (13 large pages): per-group requests wait while enough memory
    is free in total, stranded in pages of the other group; common-page's never do. Once
    drained, every page can be taken again."""
    preset = get_preset("qwen3-next-80b-a3b")
    opts = _settings(preset, GiB, "sim:h200x2")
    wl = make_workload([text_request(f"r{i}", 200 + 397 * (i % 7), 10 + 37 * (i % 5),
                                     arrival=0.05 * i) for i in range(80)])
    waits = {}
    for layout in ("common-page", "per-group"):
        engine = build_engine(engine_config("h", HybridPolicy(layout=layout), opts))
        run = run_engine(engine, wl, VirtualClock(CostModel(preset, opts.device.hardware,
                                                            opts.device.tp)))
        assert run.status == "ok", run.error
        s = summarize(run)
        waits[layout] = s["fragmentation_wait_s"], s["min_frag_index"]
        last = run.last_kv
        assert last.reserved_bytes == 0
        assert last.largest_free_bytes == last.free_bytes == last.capacity_bytes
    assert waits["common-page"] == (0.0, 1.0)
    assert waits["per-group"][0] > 0 and waits["per-group"][1] < 1
