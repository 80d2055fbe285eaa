"""Modality-aware KV: page classes per modality, their precision, pools, bytes and quality."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_driver import SMALL

from helpers import make_workload
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.kv.modal import (
    ModalKVManager,
    ModalPolicy,
    capacity_gain,
    memory_saving,
    vision_share,
)
from kvbench.engines.registry import NAMED_ENGINES, build_engine, parse_section
from kvbench.engines.sequence import Sequence
from kvbench.errors import KvbenchError
from kvbench.run.devices import parse_device
from kvbench.run.quality import agreement, run_captured, summarize_agreement
from kvbench.workloads.modalities import image_token_count
from kvbench.workloads.model import Request, Segment
from kvbench.workloads.presets import generate_preset
from kvbench.workloads.traces import import_trace

LMM = Path(__file__).parent / "fixtures" / "azure_lmm_2025_synthetic.csv"


def _settings(kv_tokens: int = 4096, device: str = "cpu", preset=SMALL) -> EngineSettings:
    return EngineSettings(
        preset=preset, device=parse_device(device),
        kv_bytes=kv_tokens * preset.kv_bytes_per_token, block_size=16, prefix_caching=False,
        scheduler=SchedulerConfig(1024, 8, 512, True),
    )


def _manager(policy: ModalPolicy, kv_tokens: int = 4096) -> ModalKVManager:
    cfg = engine_config("m", policy, _settings(kv_tokens))
    assert isinstance(cfg.section, ModalPolicy)
    return cfg.section.manager(cfg)


def _mm_request(rid: str, text: int, image: int, tail: int, output: int,
                size: int | None = None) -> Request:
    """Text, an image of ``image`` tokens (a real ``size`` px qwen2-vl image when given,
    its tokens then the rule's), text."""
    if size is not None:
        seg = Segment("image", image_token_count("qwen2-vl", size, size), f"img/{rid}",
                      height=size, width=size, rule="qwen2-vl")
    else:
        seg = Segment("image", image, f"img/{rid}")
    return Request(rid, 0.0, (Segment("text", text, f"t/{rid}"), seg,
                              Segment("text", tail, f"q/{rid}")), output)


def _seq(i: int, request: Request) -> Sequence:
    return Sequence(i, request, request.prompt_token_ids(SMALL.vocab_size))


def _fill(kv: ModalKVManager, seq: Sequence, n: int) -> None:
    assert kv.allocate(seq, 0, n)
    seq.num_computed_tokens = n
    kv.commit(seq)


def test_classes_take_their_own_slots_and_bytes() -> None:
    kv = _manager(ModalPolicy(vision_page_tokens=64, kv_dtype={"image": "int8"}))
    text, vision = kv.classes
    assert (text.dtype, vision.dtype) == ("float32", "int8")
    assert vision.bytes_per_token * 4 == text.bytes_per_token
    req = _mm_request("a", 10, 100, 7, 5)
    seq = _seq(0, req)
    _fill(kv, seq, req.prompt_tokens)
    slots = kv.slots(seq, 0, req.prompt_tokens)
    assert len(set(slots.tolist())) == req.prompt_tokens
    in_vision = (slots >= vision.base) & (slots < vision.base + vision.num_slots)
    assert in_vision.tolist() == [False] * 10 + [True] * 100 + [False] * 7
    stats = kv.stats().classes
    assert stats is not None
    assert stats["vision"]["pages"] == 2 and stats["text"]["pages"] == 2
    assert stats["vision"]["used_bytes"] == 100 * vision.bytes_per_token
    assert stats["text"]["used_bytes"] == 17 * text.bytes_per_token
    assert stats["vision"]["reserved_bytes"] == 2 * 64 * vision.bytes_per_token
    kv.free(seq)
    assert kv.stats().free_bytes == kv.geometry.pool_units[0] * kv.geometry.unit_bytes


def test_split_pools_run_out_apart_and_shared_ones_together() -> None:
    big = _mm_request("big", 16, 900, 16, 4)
    split = _manager(ModalPolicy(pools="split", vision_share=0.2))
    shared = _manager(ModalPolicy())
    # A fifth of 4096 tokens' bytes holds no 900 vision tokens; the shared pool does.
    assert "vision pages" in split.never_fits(big)
    assert shared.never_fits(big) is None
    _fill(shared, _seq(0, big), big.prompt_tokens)
    assert shared.stats().classes["vision"]["used_tokens"] == 900


def test_executor_pool_bytes_are_the_accounted_bytes() -> None:
    policy = ModalPolicy(pools="split", kv_dtype={"image": "int8", "audio": "int8"})
    cfg = engine_config("m", policy, _settings())
    engine = build_engine(cfg)
    try:
        pools = engine.executor._classes  # type: ignore[attr-defined]
        geometry = engine.kv.geometry  # type: ignore[attr-defined]
        assert sum(pools.kv_nbytes().values()) == geometry.pool_bytes
        assert geometry.pool_bytes <= cfg.kv_bytes
        assert engine.kv.capacity_tokens * engine.kv.bytes_per_token <= geometry.pool_bytes
    finally:
        engine.close()


@pytest.mark.parametrize("policy", [
    ModalPolicy(), ModalPolicy(vision_page_tokens=64, kv_dtype={"image": "int8"}),
    ModalPolicy(vision_page_tokens=512, kv_dtype={"image": "fp8_e4m3"}),
])
def test_a_shared_pool_is_one_buffer_of_the_budget(policy) -> None:
    cfg = engine_config("m", policy, _settings())
    engine = build_engine(cfg)
    try:
        pools = engine.executor._classes  # type: ignore[attr-defined]
        geometry = engine.kv.geometry  # type: ignore[attr-defined]
        # One byte buffer, both classes' views of it: the real KV memory is the budget's.
        assert list(pools.kv_nbytes()) == ["text+vision"]
        assert sum(pools.kv_nbytes().values()) == geometry.pool_bytes <= cfg.kv_bytes
        (buf,) = pools.buffers.values()
        assert buf.nbytes == geometry.pool_units[0] * geometry.unit_bytes
        assert {c.kv.untyped_storage().data_ptr() for c in pools.caches} == {
            buf.untyped_storage().data_ptr()}
        assert pools.nbytes == geometry.pool_bytes + sum(
            c.positions.nbytes for c in pools.caches)
    finally:
        engine.close()


def test_classes_of_a_shared_buffer_keep_their_pages_apart() -> None:
    # A text page and a vision page on other units: writing one leaves the other's bytes.
    from kvbench.engines.kv.class_pools import ClassPools

    kv = _manager(ModalPolicy(vision_page_tokens=64, kv_dtype={"image": "int8"}))
    pools = ClassPools(SMALL, kv.classes, torch.device("cpu"))
    text, vision = pools.caches
    unit = kv.geometry.unit_bytes
    # 64 int8 vision slots take one unit, as 16 float32 text slots do: a vision page at
    # unit 4 shares its bytes with text slots [64, 80) only.
    assert vision.spec.page_bytes == text.spec.page_bytes == unit
    first = 4 * unit // vision.spec.bytes_per_token
    vision.kv[:, :, first : first + 64] = 7
    assert int((text.kv[:, :, :64] != 0).sum()) == 0
    assert int((text.kv[:, :, 64:80] != 0).sum()) > 0
    assert int((text.kv[:, :, 80:] != 0).sum()) == 0
    text.kv[:, :, :64] = 1.5
    assert int((vision.kv[:, :, first : first + 64] != 7).sum()) == 0


def test_capacity_gain_formula_and_the_reports_25_percent() -> None:
    # The reports: half the positions vision, int8 instead of fp16: 128 KB -> 96 KB per page.
    assert memory_saving(0.5, 2, 1) == pytest.approx(0.25)
    assert 128 * (1 - memory_saving(0.5, 2, 1)) == pytest.approx(96)
    assert capacity_gain(0.5, 2, 1) == pytest.approx(4 / 3)
    assert capacity_gain(0.0, 2, 1) == 1.0


@pytest.mark.parametrize("source", ["mixed-multimodal", "azure-lmm"])
def test_measured_bytes_follow_the_formula_at_the_measured_share(source: str) -> None:
    if source == "azure-lmm":
        requests = import_trace("azure-lmm", LMM, seed=0).requests[:40]
    else:
        requests = generate_preset(source, 40, seed=0).requests
    share = vision_share(requests)
    full = _manager(ModalPolicy(), kv_tokens=1 << 17)
    int8 = _manager(ModalPolicy(kv_dtype={"image": "int8", "audio": "int8"}),
                    kv_tokens=1 << 17)
    for kv in (full, int8):
        for i, r in enumerate(requests):
            seq = _seq(i, r)
            _fill(kv, seq, r.prompt_tokens + r.output_tokens)
    used_full, used_int8 = full.stats().used_bytes, int8.stats().used_bytes
    # The tiny model is float32: int8 codes are a quarter of its bytes.
    assert used_int8 / used_full == pytest.approx(1 - memory_saving(share, 4, 1), rel=1e-12)
    # Against the reports' 25 % (fp16 -> int8 at vision share 0.5), at the measured share.
    assert 0.0 < share < 1.0
    assert memory_saving(share, 2, 1) == pytest.approx(share / 2)


def test_bad_options_are_refused() -> None:
    with pytest.raises(KvbenchError, match=r"kv_dtype\.image"):
        parse_section({"kind": "modal", "kv_dtype": {"image": "int4"}}, "suite x")
    with pytest.raises(KvbenchError, match="share the vision page class"):
        parse_section({"kind": "modal", "kv_dtype": {"image": "int8", "audio": "fp8_e4m3"}},
                      "suite x")
    with pytest.raises(KvbenchError, match="power-of-two"):
        _manager(ModalPolicy(vision_page_tokens=48))


def _mm_workload() -> list[Request]:
    return [
        _mm_request("a", 12, 0, 9, 12, size=224),
        Request("b", 0.0, (Segment("text", 30, "t/b"),), 10),
        _mm_request("c", 3, 0, 20, 8, size=336),
    ]


def test_real_compute_class_split_is_exact_and_int8_mostly_agrees() -> None:
    wl = make_workload(_mm_workload())
    settings = _settings()
    ref = run_captured("paged", NAMED_ENGINES["paged"], settings, wl)
    # float32 in both classes: attention split by class and merged is the same attention.
    same = run_captured("pages", ModalPolicy(vision_page_tokens=64), settings, wl)
    rows = agreement(ref.capture, same.capture)
    assert all(r.match_rate == 1.0 and r.first_divergence is None for r in rows)
    assert max(r.max_abs_logit_diff for r in rows) < 1e-3
    q = run_captured("int8", NAMED_ENGINES["modal-int8"], settings, wl)
    summary = summarize_agreement(agreement(ref.capture, q.capture))
    assert summary["requests"] == 3
    # The text-only request's KV is full precision: it agrees exactly.
    text_only = next(r for r in agreement(ref.capture, q.capture) if r.request_id == "b")
    assert text_only.first_divergence is None and text_only.max_abs_logit_diff == 0.0
    assert 0.0 < summary["probe_max_abs_logit_diff"] < 1.0
    assert q.describe["executor"]["weights"] == "random(seed=0)"
    assert q.summary["completed"] == 3


def test_sim_accounts_classes_and_encoder_cache() -> None:
    from kvbench.engines.model.presets import get_preset
    from kvbench.engines.sim.costmodel import CostModel
    from kvbench.run.clocks import VirtualClock
    from kvbench.run.harness import run_engine

    preset = get_preset("llama-3-8b")
    settings = _settings(16384, "sim:a100-80gb", preset)
    wl = generate_preset("mixed-multimodal", 12, seed=2)
    engine = build_engine(engine_config("m", NAMED_ENGINES["modal-pages-int8"], settings))
    run = run_engine(engine, wl, VirtualClock(CostModel(preset, settings.device.hardware, 1)))
    assert run.status == "ok", run.error
    assert run.steps.kv_class_bytes["vision_reserved_bytes"]
    assert max(run.steps.kv_class_bytes["vision_reserved_bytes"]) > 0
    assert max(run.steps.kv_encoder_cache_bytes) > 0
    assert np.all(np.asarray(run.steps.kv_class_bytes["vision_used_bytes"])
                  <= np.asarray(run.steps.kv_class_bytes["vision_reserved_bytes"]))
    # Every figure of the run is declared in the metric table, the page classes' included.
    from kvbench.results.curves import build_curves
    from kvbench.results.metric_table import CURVE_BY_NAME, METRIC_BY_NAME
    from kvbench.results.metrics import summarize

    summary, curves = summarize(run), build_curves(run.steps)
    assert set(summary) <= set(METRIC_BY_NAME) and set(curves) <= set(CURVE_BY_NAME)
    modal = {n for n, m in METRIC_BY_NAME.items() if m.needs == ("modal",)}
    assert modal <= {k for k, v in summary.items() if v is not None}
    assert {n for n, c in CURVE_BY_NAME.items() if c.needs == ("modal",)} <= set(curves)
    assert summary["kv_vision_element_bytes"] == 1 and summary["kv_vision_page_tokens"] == 512


def _image(key: str, size: int = 224) -> Segment:
    return Segment("image", image_token_count("qwen2-vl", size, size), key, height=size,
                   width=size, rule="qwen2-vl")


def test_same_image_after_same_prefix_shares_blocks_and_another_image_does_not() -> None:
    from kvbench.engines.kv.paged import PagedKVManager

    kv = PagedKVManager(256, 16, SMALL.kv_bytes_per_token, 1024)
    system = Segment("text", 40, "sys")

    def seq(i: int, image_key: str) -> Sequence:
        r = Request(f"r{i}", 0.0, (system, _image(image_key), Segment("text", 20, f"q{i}")), 4)
        return _seq(i, r)

    first = seq(0, "img/cat")
    _fill_paged(kv, first)
    image_end = 40 + _image("img/cat").tokens
    # The same image: every full block up to the image's end (and into the question's own
    # text, which differs) hits; the image's placeholder ids come from its content key, so
    # the chained block hashes carry it.
    assert kv.lookup_prefix(seq(1, "img/cat")) == image_end // 16 * 16
    # Another image after the same prefix: only the text prefix's full blocks hit.
    assert kv.lookup_prefix(seq(2, "img/dog")) == 40 // 16 * 16


def _fill_paged(kv, seq: Sequence) -> None:
    assert kv.allocate(seq, 0, seq.num_prompt_tokens)
    seq.num_computed_tokens = seq.num_prompt_tokens
    kv.commit(seq)


def _virtual():
    """Real compute under the virtual clock: which request finds which blocks cached does
    not depend on how fast this machine computes."""
    from kvbench.engines.sim.costmodel import CostModel
    from kvbench.run.clocks import VirtualClock

    return VirtualClock(CostModel(SMALL, parse_device("cpu").hardware, 1))


def test_reused_image_blocks_give_the_same_tokens_with_real_compute() -> None:
    system = Segment("text", 40, "sys")
    # A second apart on the virtual clock: each request's blocks are cached before the next.
    reqs = [Request(f"r{i}", 1.0 * i, (system, _image("img/shared"),
                                       Segment("text", 12, f"q{i}")), 6) for i in range(3)]
    wl = make_workload(reqs)
    cached = run_captured("paged", NAMED_ENGINES["paged"], _with_prefix(True), wl, _virtual())
    fresh = run_captured("paged", NAMED_ENGINES["paged"], _with_prefix(False), wl, _virtual())
    # Requests 2 and 3 find all but their last partial block cached.
    assert cached.summary["prefix_hit_rate"] > 0.5
    rows = agreement(fresh.capture, cached.capture)
    assert all(r.first_divergence is None for r in rows)
    # One encoder output served all three requests: the cache held one image's embedding.
    assert cached.summary["peak_encoder_cache_bytes"] == _image("img/shared").tokens * (
        SMALL.hidden_size * 4)


def _with_prefix(on: bool) -> EngineSettings:
    from dataclasses import replace

    return replace(_settings(), prefix_caching=on)


def test_multimodal_reuse_preset_hits_in_the_sim() -> None:
    from kvbench.engines.model.presets import get_preset
    from kvbench.engines.sim.costmodel import CostModel
    from kvbench.results.metrics import summarize
    from kvbench.run.clocks import VirtualClock
    from kvbench.run.harness import run_engine

    preset = get_preset("llama-3-8b")
    settings = _settings(65536, "sim:a100-80gb", preset)
    from dataclasses import replace

    settings = replace(settings, prefix_caching=True,
                       scheduler=SchedulerConfig(4096, 32, 2048, True))
    wl = generate_preset("multimodal-reuse", 40, seed=0)
    engine = build_engine(engine_config("paged", NAMED_ENGINES["paged"], settings))
    run = run_engine(engine, wl, VirtualClock(CostModel(preset, settings.device.hardware, 1)))
    s = summarize(run)
    assert s["prefix_hit_rate"] > 0.3
    assert s["peak_encoder_cache_bytes"] > 0


def test_agreement_on_a_checkpoint_names_its_weights(tmp_path) -> None:
    from dataclasses import replace

    from model_driver import make_model
    from test_weights import save_checkpoint

    from kvbench.run.quality import weights_used

    ckpt = save_checkpoint(make_model(seed=7), tmp_path / "ckpt")
    settings = replace(_settings(), weights=str(ckpt))
    wl = make_workload(_mm_workload()[:2])
    ref = run_captured("paged", NAMED_ENGINES["paged"], settings, wl)
    q = run_captured("int8", NAMED_ENGINES["modal-int8"], settings, wl)
    assert weights_used(q.describe) == str(ckpt)
    rows = agreement(ref.capture, q.capture)
    assert len(rows) == 2 and all(r.max_abs_logit_diff is not None for r in rows)


def test_text_pages_fragment_a_shared_pool_for_vision_pages() -> None:
    kv = _manager(ModalPolicy(vision_page_tokens=512), kv_tokens=1024)
    texts = [_seq(i, Request(f"t{i}", 0.0, (Segment("text", 16, f"t{i}"),), 1))
             for i in range(64)]
    for s in texts:
        _fill(kv, s, 16)
    for s in texts[::2]:
        kv.free(s)
    stats = kv.stats()
    assert stats.free_bytes == 32 * 16 * SMALL.kv_bytes_per_token
    # Half the pool is free, in single text pages: no 512-token vision page can be formed.
    assert stats.largest_free_bytes == 0
    image = _seq(99, _mm_request("img", 0, 500, 0, 1))
    assert not kv.allocate(image, 0, 500)
    split = _manager(ModalPolicy(vision_page_tokens=512, pools="split"), kv_tokens=2048)
    for i in range(64):
        _fill(split, _seq(i, Request(f"t{i}", 0.0, (Segment("text", 16, f"t{i}"),), 1)), 16)
    assert split.allocate(_seq(99, _mm_request("img", 0, 500, 0, 1)), 0, 500)
