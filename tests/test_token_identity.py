"""Every KV policy computes the same thing as contiguous: identical greedy tokens.

Same workload, same weights: every request's output ids (digested in the run record) must
match across KV managers, with chunked prefill on and off, with prefix caching and either
eviction, when the engine is forced to preempt and recompute, when pages merge, migrate,
map ahead or are held back as headroom, when extents are compacted or aligned, and under a
sliding window with and without releasing the blocks outside it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers import make_workload
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSection, EngineSettings, engine_config
from kvbench.engines.kv.contiguous import ContiguousPolicy
from kvbench.engines.kv.modal import ModalPolicy
from kvbench.engines.kv.offload import OffloadSpec
from kvbench.engines.kv.paged import PagedPolicy
from kvbench.engines.kv.paged_mixed import PagedMixedPolicy
from kvbench.engines.kv.segmented import SegmentedPolicy
from kvbench.engines.kv.vattention import VAttentionPolicy
from kvbench.engines.model.presets import ModelPreset, get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.results.metrics import summarize
from kvbench.run.clocks import WallClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine
from kvbench.workloads.model import Request, Segment


def _workload():
    shared = Segment("text", 40, "shared/system")
    reqs = []
    for i in range(6):
        segs = [shared, Segment("text", 17 + 9 * i, f"user/{i}")]
        if i % 3 == 1:
            segs.append(Segment("image", 257, f"img/{i}", height=224, width=224, rule="vit-l14"))
        if i == 4:
            segs.append(Segment("audio", 50, "aud/4", seconds=1.0))
        reqs.append(Request(f"r{i}", 0.0, tuple(segs), 6 + i))
    return make_workload(reqs)


def _outputs(engine: str, kv_tokens: int, *, chunked: bool = True, batched: int = 512,
             prefix: bool = True, section: EngineSection | None = None,
             preset: ModelPreset | None = None, attention: str = "auto",
             ) -> tuple[dict[str, str], dict]:
    preset = preset or get_preset("tiny")
    opts = EngineSettings(
        preset=preset,
        attention=attention,
        device=parse_device("cpu"),
        kv_bytes=kv_tokens * preset.kv_bytes_per_token,
        block_size=16,
        prefix_caching=prefix,
        scheduler=SchedulerConfig(
            max_model_len=1024, max_num_seqs=8,
            max_num_batched_tokens=batched if chunked else 1024, chunked_prefill=chunked,
        ),
    )
    engine_ = build_engine(engine_config(engine, section or NAMED_ENGINES[engine], opts))
    run = run_engine(engine_, _workload(), WallClock())
    assert run.status == "ok", run.error
    digests = {rid: t.output_digest for rid, t in run.timings.items()}
    assert all(d is not None for d in digests.values())
    return digests, summarize(run)


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Contiguous, one-shot prefill, no sharing: the plainest path."""
    return _outputs("contiguous-request", 8192, chunked=False)[0]


def test_paged_matches_contiguous(reference) -> None:
    assert _outputs("paged", 8192, chunked=False, prefix=False)[0] == reference


@pytest.mark.parametrize("engine", ["paged", "contiguous-request"])
def test_the_torch_reference_kernels_give_the_same_tokens(reference, engine) -> None:
    # The fixture runs the CPU's default kernels (the native decode kernel where it builds).
    assert _outputs(engine, 8192, chunked=False, attention="reference")[0] == reference


def test_chunked_prefill_matches(reference) -> None:
    assert _outputs("paged", 8192, batched=64)[0] == reference
    assert _outputs("contiguous-request", 8192, batched=64)[0] == reference


def test_prefix_caching_matches(reference) -> None:
    digests, summary = _outputs("paged", 8192, prefix=True)
    assert summary["prefix_hit_rate"] > 0
    assert digests == reference


@pytest.mark.parametrize("kv_tokens", [8192, 640])
def test_modal_prefix_caching_matches(reference, kv_tokens) -> None:
    # Text and vision page classes in the model's float32, sharing cached pages of both
    # classes; at 640 slots cached pages are evicted and requests preempted too.
    digests, summary = _outputs(f"modal/{kv_tokens}", kv_tokens, batched=128,
                                section=ModalPolicy(prefix_caching=True))
    assert summary["prefix_hit_rate"] > 0
    if kv_tokens < 8192:
        assert summary["preemptions"] > 0 and summary["kv_evictions"] > 0
    assert digests == reference


def test_preemption_and_recompute_match(reference) -> None:
    # 640 slots hold about two of these requests at a time: the scheduler must preempt.
    digests, summary = _outputs("paged", 640, batched=128)
    assert summary["preemptions"] > 0
    assert digests == reference


@pytest.mark.parametrize("tier", ["cpu:1MiB", "cpu:64KiB"])
def test_swap_preemption_matches(reference, tier) -> None:
    # The same pressure; the preempted sequences' KV is copied to host memory and back
    # (a tier too small for it: recomputed instead).
    digests, summary = _outputs("paged-swap", 640, batched=128, section=PagedPolicy(
        offload=OffloadSpec(tiers=tier), preemption="swap"))
    assert summary["preemptions"] > 0
    assert (summary["offload_swapped_in_bytes"] > 0) == (tier == "cpu:1MiB")
    assert digests == reference


def test_paged_mixed_matches_with_merges_migration_and_preemption(reference) -> None:
    # Small classes (16/64/256-token pages past 63/255 tokens) and 16-token prefill chunks,
    # so that these requests grow through every class: a prefill running alone fills
    # adjacent small pages that merge, one interleaved with decodes gets scattered ones that
    # migrate (real copies); at 640 slots the scheduler preempts.
    section = PagedMixedPolicy(class_limits=(63, 255), migrate=True)
    digests, summary = _outputs("mixed", 8192, batched=16, section=section)
    assert summary["kv_merges"] > 0 and summary["kv_migrated_bytes"] > 0
    assert digests == reference
    digests, summary = _outputs("mixed", 640, batched=128, section=section)
    assert summary["preemptions"] > 0
    assert digests == reference


def test_segmented_matches_with_heads_tails_and_preemption(reference) -> None:
    # 64-token heads: every request has a contiguous head and a paged tail.
    section = SegmentedPolicy(head_tokens=64)
    assert _outputs("segmented", 8192, batched=64, section=section)[0] == reference
    digests, summary = _outputs("segmented", 640, batched=128, section=section)
    assert summary["preemptions"] > 0
    assert digests == reference


@pytest.mark.parametrize("section", [
    VAttentionPolicy(page_bytes=64 << 10),
    VAttentionPolicy(page_bytes=64 << 10, prewarm_pages=4, prewarm="hint"),
], ids=["sync", "prewarm+hint"])
def test_vattention_matches_with_mapping_and_preemption(reference, section) -> None:
    # tiny at 64 KiB pages: 256-token page groups, translated through the block table.
    digests, summary = _outputs("vattention", 8192, batched=64, section=section)
    assert summary["kv_map_ops"] > 0
    assert digests == reference
    digests, summary = _outputs("vattention", 640, batched=128, section=section)
    assert summary["preemptions"] > 0
    assert digests == reference


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_prefix_cache_eviction_variants_match_under_pressure(reference, eviction) -> None:
    # 640 slots: cached blocks of finished and preempted requests must be evicted for room.
    digests, summary = _outputs(eviction, 640, batched=128, section=PagedPolicy(eviction=eviction))
    assert summary["kv_evictions"] > 0 and summary["preemptions"] > 0
    assert summary["prefix_hit_rate"] > 0
    assert digests == reference


@pytest.mark.parametrize("section", [
    ContiguousPolicy(reservation="request", compaction=True),
    ContiguousPolicy(reservation="request", auto_defrag=0.9),
], ids=["compaction", "auto_defrag"])
def test_contiguous_compaction_moves_keep_the_tokens(reference, section) -> None:
    # 640 slots: extents come and go, leaving holes the compactor closes by real copies.
    digests, summary = _outputs("compact", 640, batched=64, section=section)
    assert summary["kv_copied_bytes"] > 0
    assert digests == reference


def test_aligned_extents_keep_the_tokens_and_waste_the_rounding(reference) -> None:
    # tiny holds 256 B of one layer's K per token: 4096-byte alignment is 16-token extents.
    plain = _outputs("plain", 8192, batched=64,
                     section=ContiguousPolicy(reservation="request"))
    aligned = _outputs("aligned", 8192, batched=64,
                       section=ContiguousPolicy(reservation="request", align_bytes=4096))
    assert plain[0] == aligned[0] == reference
    assert aligned[1]["peak_kv_reserved_bytes"] > plain[1]["peak_kv_reserved_bytes"]


@pytest.mark.parametrize("section", [
    PagedPolicy(reserved_memory=0.25), SegmentedPolicy(head_tokens=64, reserved_memory=0.25),
    PagedMixedPolicy(class_limits=(63, 255), reserved_memory=0.25),
    VAttentionPolicy(page_bytes=64 << 10, reserved_memory=0.25),
    ContiguousPolicy(reservation="request", reserved_memory=0.25),
], ids=["paged", "segmented", "paged-mixed", "vattention", "contiguous"])
def test_headroom_keeps_the_tokens_in_the_smaller_pool(reference, section) -> None:
    # 1024 slots with a quarter held back: the pool is about 768 slots.
    digests, summary = _outputs("headroom", 1024, batched=128, section=section)
    assert summary["kv_capacity_bytes"] <= 0.75 * 1024 * get_preset("tiny").kv_bytes_per_token
    assert digests == reference


def test_paged_mixed_prewarm_keeps_the_tokens(reference) -> None:
    section = PagedMixedPolicy(class_limits=(63, 255), migrate=True, prewarm_pages=8)
    digests, summary = _outputs("prewarm", 8192, batched=16, section=section)
    assert summary["kv_splits"] > 0 and summary["kv_migrated_bytes"] > 0
    assert digests == reference
    assert _outputs("prewarm", 640, batched=128, section=section)[0] == reference


# tiny with a 48-position sliding window: shorter than every request here.
WINDOWED = replace(get_preset("tiny"), name="tiny-swa", sliding_window=48,
                   hf_architecture="MistralForCausalLM")


@pytest.fixture(scope="module")
def windowed_reference() -> dict[str, str]:
    return _outputs("contiguous-request", 8192, chunked=False, preset=WINDOWED)[0]


def test_sliding_window_changes_the_tokens(reference, windowed_reference) -> None:
    assert windowed_reference != reference


@pytest.mark.parametrize("section", [
    PagedPolicy(), PagedPolicy(sliding_window_release=True), SegmentedPolicy(head_tokens=64),
    PagedPolicy(eviction="lfu", sliding_window_release=True),
    PagedMixedPolicy(class_limits=(63, 255), migrate=True), VAttentionPolicy(page_bytes=64 << 10),
    VAttentionPolicy(page_bytes=64 << 10, prewarm_pages=4, prewarm="hint"),
    ContiguousPolicy(reservation="request", auto_defrag=0.9, align_bytes=4096),
], ids=["paged", "paged-release", "segmented", "paged-lfu-release", "paged-mixed-migrate",
        "vattention", "vattention-prewarm+hint", "contiguous-defrag+align"])
def test_every_policy_matches_under_a_sliding_window(windowed_reference, section) -> None:
    digests, _ = _outputs("windowed", 8192, batched=64, section=section, preset=WINDOWED)
    assert digests == windowed_reference


def test_releasing_blocks_outside_the_window_keeps_the_tokens_and_frees_memory(
    windowed_reference,
) -> None:
    kept = _outputs("kept", 640, batched=128, section=PagedPolicy(), preset=WINDOWED)
    freed = _outputs("freed", 640, batched=128, section=PagedPolicy(sliding_window_release=True),
                     preset=WINDOWED)
    assert kept[0] == freed[0] == windowed_reference
    # 640 slots: kept blocks force preemptions; freed ones leave room (no machine timing).
    assert freed[1]["preemptions"] < kept[1]["preemptions"]
    assert freed[1]["peak_kv_used_bytes"] < kept[1]["peak_kv_used_bytes"]
