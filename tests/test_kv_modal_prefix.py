"""Prefix caching and forks in the modal KV policy: pages of each class shared by chained
hashes over both classes' tokens or by forked samples (copy-on-write per class), reference
counts, the LRU queue of free cached pages, and the same image after the same prefix
hitting where another image does not."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_driver import VOCAB, KVDriver
from model_driver import SMALL

from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.kv.modal import ModalKVManager, ModalPolicy
from kvbench.engines.sequence import Sequence
from kvbench.run.devices import parse_device
from kvbench.workloads.modalities import image_token_count
from kvbench.workloads.model import Request, Segment

POLICIES = {
    "shared": ModalPolicy(prefix_caching=True),
    "shared-32": ModalPolicy(prefix_caching=True, vision_page_tokens=32),
    "shared-int8": ModalPolicy(prefix_caching=True, vision_page_tokens=64,
                               kv_dtype={"image": "int8"}),
    "split": ModalPolicy(prefix_caching=True, vision_page_tokens=32, pools="split"),
}


def manager(policy: ModalPolicy, kv_tokens: int) -> ModalKVManager:
    settings = EngineSettings(
        preset=SMALL, device=parse_device("cpu"),
        kv_bytes=kv_tokens * SMALL.kv_bytes_per_token, block_size=16, prefix_caching=False,
        scheduler=SchedulerConfig(1024, 8, 512, True),
    )
    cfg = engine_config("m", policy, settings)
    assert isinstance(cfg.section, ModalPolicy)
    return cfg.section.manager(cfg)


def driver(kv: ModalKVManager, seed: int = 0) -> KVDriver:
    d = KVDriver(kv, seed)
    # The flat slots put each class's slot space after the other's.
    d.mem = np.full(sum(c.num_slots for c in kv.classes), -1, dtype=np.int64)
    return d


def mm_seq(i: int, system: tuple[str, int], image: tuple[str, int] | None, question: int,
           output: int, vocab: int = VOCAB, n: int = 1) -> Sequence:
    segments = [Segment("text", system[1], system[0])]
    if image is not None:
        segments.append(Segment("image", image[1], image[0]))
    if question:
        segments.append(Segment("text", question, f"q/{i}"))
    request = Request(f"r{i}", 0.0, tuple(segments), output, n=n)
    return Sequence(i, request, request.prompt_token_ids(vocab))


def check_invariants(kv: ModalKVManager, d: KVDriver) -> None:
    unit = kv.geometry.unit_bytes
    refs: list[Counter[int]] = [Counter(), Counter()]
    for seq in d.running:
        for k, c in enumerate(kv.classes):
            for first in kv._seqs[seq.seq_id].pages[k].starts:
                refs[k][first // c.page_tokens] += 1
    for k in range(2):
        assert all(r >= 0 for r in kv._ref[k])
        assert {p: r for p, r in enumerate(kv._ref[k]) if r} == dict(refs[k])
    # Free buddy pages, held pages and free cached pages tile every pool's units once.
    pools = [kv._pools[0]] if kv.geometry.pools == "shared" else kv._pools
    owners = [[0] * p.num_units for p in pools]
    for pi, pool in enumerate(pools):
        for order in range(pool.top + 1):
            for start in pool._free[order]:
                for u in range(start, start + pool.sizes[order]):
                    owners[pi][u] += 1
    cached = [0, 0]
    for q in kv._lru:
        for k, page in q:
            assert kv._ref[k][page] == 0 and kv._hash[k][page] is not None
            cached[k] += 1
    assert cached == kv._cached_free
    for k, c in enumerate(kv.classes):
        pi = 0 if len(pools) == 1 else k
        live = set(refs[k]) | {p for q in kv._lru for kk, p in q if kk == k}
        for page in live:
            first = page * c.page_bytes // unit
            for u in range(first, first + c.page_bytes // unit):
                owners[pi][u] += 1
        for key, page in kv._by_hash[k].items():
            assert kv._hash[k][page] == key
    assert all(o == [1] * len(o) for o in owners)  # no unit twice, none lost
    s = kv.stats()
    scales = sum(c.scale_bytes for c in kv.classes)
    assert s.free_bytes + s.reserved_bytes + scales == s.capacity_bytes
    fill = 0
    for k, c in enumerate(kv.classes):
        seen: dict[int, int] = {}
        for seq in d.running:
            pages = kv._seqs[seq.seq_id].pages[k]
            for i, first in enumerate(pages.starts):
                f = min(max(pages.committed - i * c.page_tokens, 0), c.page_tokens)
                page = first // c.page_tokens
                assert seen.setdefault(page, f) == f  # sharers hold the same KV
        fill += sum(seen.values()) * c.bytes_per_token
    assert s.used_bytes == fill
    assert s.prefix_hit_tokens is not None and s.prefix_query_tokens is not None
    assert 0 <= s.prefix_hit_tokens <= s.prefix_query_tokens
    assert 0 <= s.shared_bytes <= s.reserved_bytes
    d.check_contents()


@settings(max_examples=100, deadline=None)
@given(data=st.data(), policy=st.sampled_from(sorted(POLICIES)),
       kv_tokens=st.sampled_from([192, 256, 512]), seed=st.integers(0, 2**16))
def test_random_operations_keep_invariants(data, policy, kv_tokens, seed) -> None:
    kv = manager(POLICIES[policy], kv_tokens)
    d = driver(kv, seed)
    waiting: list[Sequence] = []
    for i in range(data.draw(st.integers(1, 50), label="ops")):
        op = data.draw(st.sampled_from(["new", "admit", "step", "step", "step", "preempt"]))
        if op == "new":
            system = data.draw(st.sampled_from([("s0", 16), ("s0", 24), ("s1", 32)]))
            image = data.draw(st.sampled_from([None, ("i0", 16), ("i0", 32), ("i1", 32),
                                               ("i2", 48)]))
            seq = mm_seq(i, system, image, data.draw(st.integers(0, 20)),
                         data.draw(st.integers(1, 12)), n=data.draw(st.integers(1, 3)))
            if kv.never_fits(seq.request) is None:
                waiting.append(seq)
        elif op == "admit" and waiting:
            seq = waiting[0]
            if d.admit(seq, data.draw(st.integers(1, 64))):
                waiting.remove(seq)
        elif op == "step" and d.running:
            seq = data.draw(st.sampled_from(d.running))
            if not d.step(seq, data.draw(st.integers(1, 16))):
                victim = d.running[-1]
                d.preempt(victim)
                waiting.append(victim)
        elif op == "preempt" and d.running:
            seq = data.draw(st.sampled_from(d.running))
            d.preempt(seq)
            waiting.append(seq)
        check_invariants(kv, d)
    for seq in list(d.running):
        d.free(seq)
    for seq in waiting:
        kv.free(seq)
    check_invariants(kv, d)
    # All returned after the drain: nothing held, every unit free or cached-free.
    s = kv.stats()
    assert s.reserved_bytes == 0 and s.used_bytes == 0 and s.shared_bytes == 0
    assert all(r == 0 for refs in kv._ref for r in refs)
    assert s.free_bytes == sum(kv.geometry.pool_units) * kv.geometry.unit_bytes


def _image(key: str, size: int = 224) -> tuple[str, int]:
    return key, image_token_count("qwen2-vl", size, size)


def _fill(kv: ModalKVManager, seq: Sequence) -> None:
    cached = kv.lookup_prefix(seq)
    assert kv.allocate(seq, cached, seq.num_prompt_tokens - cached)
    seq.num_computed_tokens = seq.num_prompt_tokens
    kv.commit(seq)


@pytest.mark.parametrize("policy", ["shared", "shared-int8", "split"])
def test_same_image_after_same_prefix_hits_and_another_image_does_not(policy) -> None:
    kv = manager(POLICIES[policy], 4096)
    system, cat, dog = ("sys", 48), _image("img/cat"), _image("img/dog")
    assert cat[1] == 64
    first = mm_seq(0, system, cat, 20, 4, SMALL.vocab_size)
    _fill(kv, first)
    # The same image after the same prefix: every page of both classes up to the image's
    # end hits (the question differs); its placeholder ids come from its content key.
    again = mm_seq(1, system, cat, 20, 4, SMALL.vocab_size)
    assert kv.lookup_prefix(again) == 48 + 64
    # Another image: only the text prefix's pages.
    assert kv.lookup_prefix(mm_seq(2, system, dog, 20, 4, SMALL.vocab_size)) == 48
    # Another prefix before the same image: nothing (the chain covers the text before it).
    other = mm_seq(3, ("sys2", 48), cat, 20, 4, SMALL.vocab_size)
    assert kv.lookup_prefix(other) == 0
    _fill(kv, again)
    s = kv.stats()
    assert s.prefix_hit_tokens == 48 + 64 and s.prefix_query_tokens == 2 * (48 + 64 + 20)
    vision_page = kv.classes[1].page_tokens
    shared = 3 * kv.classes[0].page_bytes + 64 // vision_page * kv.classes[1].page_bytes
    assert s.shared_bytes == shared
    # The hit pages are the first sequence's, in both classes.
    for k in range(2):
        n = 3 if k == 0 else 64 // vision_page
        assert kv._seqs[1].pages[k].starts[:n] == kv._seqs[0].pages[k].starts[:n]


def test_a_hit_stops_where_a_class_page_is_not_full() -> None:
    # 40 text tokens before the image: text page 2 holds 8 tokens before the image and 8
    # of the question after it, so nothing past the first two text pages can hit.
    kv = manager(POLICIES["shared"], 4096)
    _fill(kv, mm_seq(0, ("sys", 40), _image("img/cat"), 20, 4, SMALL.vocab_size))
    assert kv.lookup_prefix(mm_seq(1, ("sys", 40), _image("img/cat"), 20, 4,
                                   SMALL.vocab_size)) == 32


def test_free_cached_pages_are_evicted_lru_when_the_pool_runs_out() -> None:
    kv = manager(POLICIES["shared"], 192)  # 12 pages of 16 tokens
    a = mm_seq(0, ("a", 64), ("img/a", 64), 0, 1, SMALL.vocab_size)  # 8 pages
    _fill(kv, a)
    a.output_ids.append(0)
    kv.free(a)
    assert kv.stats().free_bytes == kv.stats().capacity_bytes
    b = mm_seq(1, ("a", 64), ("img/a", 64), 4, 1, SMALL.vocab_size)
    assert kv.lookup_prefix(b) == 128
    c = mm_seq(2, ("c", 64), ("img/c", 64), 0, 1, SMALL.vocab_size)
    _fill(kv, c)  # 8 pages: 4 free ones, then 4 evicted cached ones
    s = kv.stats()
    assert s.evictions == 4
    # The least recently freed are gone: the tail pages, queued first, went first.
    assert kv.lookup_prefix(b) < 128


def _reuse_workload():
    from helpers import make_workload

    system = Segment("text", 48, "sys")
    image = Segment("image", 64, "img/shared", height=224, width=224, rule="qwen2-vl")
    other = Segment("image", 64, "img/other", height=224, width=224, rule="qwen2-vl")
    # A second apart on the virtual clock (_virtual): each request's blocks are cached
    # before the next arrives, however fast this machine computes.
    reqs = [Request(f"r{i}", 1.0 * i, (system, other if i == 2 else image,
                                       Segment("text", 12, f"q{i}")), 6) for i in range(4)]
    return make_workload(reqs)


def _virtual():
    from kvbench.engines.sim.costmodel import CostModel
    from kvbench.run.clocks import VirtualClock

    return VirtualClock(CostModel(SMALL, parse_device("cpu").hardware, 1))


def _real(prefix: bool) -> EngineSettings:
    return EngineSettings(
        preset=SMALL, device=parse_device("cpu"), kv_bytes=4096 * SMALL.kv_bytes_per_token,
        block_size=16, prefix_caching=prefix, scheduler=SchedulerConfig(1024, 8, 512, True),
    )


def test_reused_image_pages_give_the_tokens_of_paged_with_real_compute() -> None:
    from kvbench.engines.registry import NAMED_ENGINES
    from kvbench.tools.kv_quality import agreement, run_captured

    wl = _reuse_workload()
    paged = run_captured("paged", NAMED_ENGINES["paged"], _real(True), wl, _virtual())
    modal = run_captured("modal", ModalPolicy(), _real(True), wl, _virtual())
    assert modal.describe["kv_manager"]["enable_prefix_caching"] is True
    # Both classes in float32: the same greedy tokens as paged, both reusing the image.
    assert modal.capture.tokens == paged.capture.tokens
    assert modal.summary["prefix_hit_rate"] == pytest.approx(paged.summary["prefix_hit_rate"])
    assert modal.summary["prefix_hit_rate"] > 0.5
    # int8 vision pages reused as int8 (codes and scales as written): the same tokens and
    # first-token logits as the same policy computing every image afresh.
    fresh = run_captured("int8", NAMED_ENGINES["modal-int8"], _real(False), wl, _virtual())
    reused = run_captured("int8", NAMED_ENGINES["modal-int8"], _real(True), wl, _virtual())
    assert reused.summary["prefix_hit_rate"] > 0.5
    rows = agreement(fresh.capture, reused.capture)
    assert all(r.first_divergence is None for r in rows)
    assert max(r.max_abs_logit_diff for r in rows) < 1e-4


def test_forked_samples_copy_on_write_per_class_and_keep_paged_tokens() -> None:
    from helpers import make_workload
    from kvbench.engines.registry import NAMED_ENGINES, build_engine
    from kvbench.results.metrics import summarize
    from kvbench.run.clocks import WallClock
    from kvbench.run.harness import run_engine

    image = Segment("image", 64, "img/shared", height=224, width=224, rule="qwen2-vl")
    # 21 and 30 text tokens: each prompt ends inside a text page, which the samples share
    # until each writes its own token there.
    reqs = [Request("a", 0.0, (Segment("text", 13, "sys"), image, Segment("text", 8, "qa")),
                    6, n=3),
            Request("b", 0.0, (Segment("text", 30, "tb"),), 5, n=2),
            Request("c", 0.01, (Segment("text", 13, "sys"), image, Segment("text", 5, "qc")),
                    4, n=2)]
    wl = make_workload(reqs)

    def digests(name: str, section) -> tuple[dict, dict]:
        engine = build_engine(engine_config(name, section, _real(True)))
        run = run_engine(engine, wl, WallClock())
        assert run.status == "ok", run.error
        return {rid: t.output_digest for rid, t in run.timings.items()}, summarize(run)

    want, _ = digests("paged", NAMED_ENGINES["paged"])
    got, summary = digests("modal", ModalPolicy())
    assert got == want
    assert summary["kv_copied_bytes"] > 0 and summary["completed"] == 3
    _, summary = digests("int8", NAMED_ENGINES["modal-int8"])
    assert summary["completed"] == 3 and summary["kv_copied_bytes"] > 0
    # int8 vision codes and their scales copied with the page: the first sample's tokens are
    # those of the same requests run without forks.
    from dataclasses import replace

    from kvbench.tools.kv_quality import run_captured

    single = make_workload([replace(r, n=1) for r in reqs])
    forked = run_captured("int8", NAMED_ENGINES["modal-int8"], _real(True), wl)
    alone = run_captured("int8", NAMED_ENGINES["modal-int8"], _real(True), single)
    assert forked.capture.tokens == alone.capture.tokens


def test_int8_vision_in_a_shared_buffer_computes_what_split_pools_do() -> None:
    # Decodes batched with a prefill read whole units past their own pages; in one byte
    # buffer those can hold the other class's codes (NaN as float32), which must not leak.
    from helpers import make_workload
    from kvbench.tools.kv_quality import run_captured

    image = Segment("image", 64, "img/shared", height=224, width=224, rule="qwen2-vl")
    reqs = [Request("a", 0.0, (Segment("text", 13, "sys"), image, Segment("text", 8, "qa")), 6),
            Request("b", 0.0, (Segment("text", 30, "tb"),), 5),
            Request("c", 0.01, (Segment("text", 13, "sys"), image, Segment("text", 5, "qc")),
                    4)]
    wl = make_workload(reqs)
    for prefix in (False, True):
        shared = run_captured("s", ModalPolicy(kv_dtype={"image": "int8"}), _real(prefix), wl)
        split = run_captured("p", ModalPolicy(kv_dtype={"image": "int8"}, pools="split"),
                             _real(prefix), wl)
        assert shared.capture.tokens == split.capture.tokens


def test_multimodal_reuse_preset_hits_on_modal_as_on_paged_in_the_sim() -> None:
    from dataclasses import replace

    from kvbench.engines.model.presets import get_preset
    from kvbench.engines.registry import NAMED_ENGINES, build_engine
    from kvbench.engines.sim.costmodel import CostModel
    from kvbench.results.metrics import summarize
    from kvbench.run.clocks import VirtualClock
    from kvbench.run.harness import run_engine
    from kvbench.workloads.presets import generate_preset

    preset = get_preset("llama-3-8b")
    settings = EngineSettings(
        preset=preset, device=parse_device("sim:a100-80gb"), kv_bytes=1 << 30, block_size=16,
        prefix_caching=True, scheduler=SchedulerConfig(4096, 32, 2048, True),
    )
    wl = generate_preset("multimodal-reuse", 40, seed=0)
    wl = replace(wl, requests=[replace(r, arrival_s=0.0) for r in wl.requests])
    rates = {}
    for name in ("paged", "modal-int8", "modal-pages"):
        engine = build_engine(engine_config(name, NAMED_ENGINES[name], settings))
        run = run_engine(engine, wl, VirtualClock(CostModel(preset, settings.device.hardware, 1)))
        assert run.status == "ok", run.error
        rates[name] = summarize(run)["prefix_hit_rate"]
    # 16-token pages in both classes: the preset's 128/256-token prefixes and 192-384-token
    # images end on page boundaries, so modal hits about as paged does.
    assert rates["paged"] > 0.3
    assert abs(rates["modal-int8"] - rates["paged"]) < 0.05
    # 512-token vision pages: no image fills one, so only the text before the image hits.
    assert 0.0 < rates["modal-pages"] < rates["modal-int8"]
