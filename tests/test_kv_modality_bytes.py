"""KV bytes by the modality of the tokens held: exact against token counts, per step, for the
modality-aware pool (text and vision at different dtypes) and a flat pool, with and without
decode fast-forward; None, never zero, where the bytes cannot be attributed."""

from __future__ import annotations

import numpy as np

from helpers import make_workload
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.kv.modal import ModalPolicy
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sim.costmodel import CostModel
from kvbench.results.curves import build_curves
from kvbench.results.metrics import summarize
from kvbench.run.clocks import VirtualClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine
from kvbench.workloads.model import Request, Segment

PRESET = get_preset("llama-3-8b")  # bfloat16: 2 bytes per element
ELEMENTS = PRESET.kv_bytes_per_token // PRESET.dtype_bytes  # per token, all layers, K and V


def _settings(prefix: bool = False, kv_tokens: int = 6000) -> EngineSettings:
    return EngineSettings(
        preset=PRESET, device=parse_device("sim:a100-80gb"),
        kv_bytes=kv_tokens * PRESET.kv_bytes_per_token, block_size=16, prefix_caching=prefix,
        scheduler=SchedulerConfig(4096, 8, 256, True),
    )


def _requests() -> list[Request]:
    """Text, an image and audio in different orders, arriving over time (some overlap)."""
    out = []
    for i in range(6):
        segs = [Segment("text", 13 + i, f"t{i}"), Segment("image", 100 + 7 * i, f"img{i}"),
                Segment("text", 5, f"q{i}"), Segment("audio", 50 + 3 * i, f"aud{i}",
                                                     seconds=1.0)]
        if i % 2:
            segs = [segs[0], segs[3], segs[2], segs[1]]
        out.append(Request(f"r{i}", 0.02 * i, tuple(segs), 9 + i))
    return out


def _expected(seqs) -> dict[str, int]:
    """Tokens of each modality the sequences hold, position by position."""
    out = {"text": 0, "image": 0, "audio": 0}
    for seq in seqs:
        kinds = np.repeat([s.kind for s in seq.request.segments],
                          [s.tokens for s in seq.request.segments])
        held = seq.num_computed_tokens
        prompt = kinds[:held]
        for m in out:
            out[m] += int((prompt == m).sum())
        out["text"] += max(0, held - len(kinds))  # generated tokens
    return out


def test_modal_pool_bytes_per_modality_are_tokens_times_their_dtype() -> None:
    # Text in float32 (4 bytes), image and audio in int8 (1 byte) codes with scales.
    policy = ModalPolicy(kv_dtype={"text": "float32", "image": "int8", "audio": "int8"})
    engine = build_engine(engine_config("m", policy, _settings()))
    for r in _requests():
        engine.add(r)
    both = 0
    while engine.has_unfinished():
        kv = engine.step().kv
        want = _expected(engine.scheduler.running)
        mods = kv.modalities
        assert mods is not None
        assert mods["text"]["dtype"] == "float32" and mods["image"]["dtype"] == "int8"
        for m, per_element in (("text", 4), ("image", 1), ("audio", 1)):
            assert mods[m]["tokens"] == want[m]
            assert mods[m]["used_bytes"] == want[m] * ELEMENTS * per_element
        assert mods["text"]["used_bytes"] == kv.classes["text"]["used_bytes"]
        assert (mods["image"]["used_bytes"] + mods["audio"]["used_bytes"]
                == kv.classes["vision"]["used_bytes"])
        assert sum(f["used_bytes"] for f in mods.values()) == kv.used_bytes
        # The scales: one float32 per 16 slots, layer, K or V and KV head, stated per token.
        scale = PRESET.num_layers * 2 * PRESET.num_kv_heads * 4 / 16
        assert mods["image"]["scale_bytes_per_token"] == scale
        assert mods["text"]["scale_bytes_per_token"] == 0.0
        both += want["image"] > 0 and want["audio"] > 0
    assert both > 0  # image and audio were held at once


def _paged_run(fast_forward: bool, prefix: bool = False, requests=None, engine="paged"):
    engine = build_engine(engine_config(engine, NAMED_ENGINES[engine], _settings(prefix)))
    clock = VirtualClock(CostModel(PRESET, parse_device("sim:a100-80gb").hardware, 1))
    run = run_engine(engine, make_workload(requests or _requests()), clock,
                     fast_forward=fast_forward)
    assert run.status == "ok", run.error
    return run


def test_flat_pool_bytes_per_modality_sum_to_used_bytes_with_fast_forward() -> None:
    stepwise, bulk = _paged_run(False), _paged_run(True)
    assert bulk.fast_forward_steps > 0
    assert bulk.steps.kv_modality_bytes == stepwise.steps.kv_modality_bytes
    cols = bulk.steps.kv_modality_bytes
    total = np.sum([cols[m] for m in ("text", "image", "audio")], axis=0)
    assert total.tolist() == bulk.steps.kv_used_bytes
    assert max(cols["image"]) > 0 and max(cols["audio"]) > 0
    s = summarize(bulk)
    assert s["peak_kv_image_bytes"] == max(cols["image"])
    assert s["kv_image_dtype_bytes"] == s["kv_text_dtype_bytes"] == 2
    assert {"kv_text_bytes", "kv_image_bytes", "kv_audio_bytes"} <= set(build_curves(bulk.steps))


def _shared_image_requests() -> list[Request]:
    system, image = Segment("text", 48, "sys"), Segment("image", 160, "img/same")
    return [Request(f"r{i}", 0.0, (system, image, Segment("text", 8, f"q{i}")), 30)
            for i in range(3)]


def test_shared_blocks_are_counted_once() -> None:
    reqs = _shared_image_requests()
    for fast_forward in (False, True):
        run = _paged_run(fast_forward, prefix=True, requests=reqs)
        assert summarize(run)["prefix_hit_rate"] > 0
        assert max(run.steps.kv_shared_bytes) > 0
        cols = run.steps.kv_modality_bytes
        total = np.sum([cols[m] for m in ("text", "image", "audio")], axis=0)
        assert total.tolist() == run.steps.kv_used_bytes
    # The image's blocks (48 + 160 = 13 full blocks after the same prefix) are held once
    # however many requests share them: r0 and r1 computed theirs in the same steps, before
    # either was cached, and r2 shares r0's.
    assert summarize(run)["peak_kv_image_bytes"] == 2 * 160 * PRESET.kv_bytes_per_token
    s = summarize(_paged_run(True, requests=reqs))
    assert s["peak_kv_image_bytes"] == 3 * 160 * PRESET.kv_bytes_per_token


def test_forked_samples_share_their_prompt_blocks_once() -> None:
    reqs = [Request(f"r{i}", 0.01 * i, (Segment("text", 21, f"t{i}"),
                                        Segment("image", 90, f"img{i}"),
                                        Segment("audio", 40, f"a{i}", seconds=0.8)), 20, n=3)
            for i in range(3)]
    for prefix in (False, True):
        run = _paged_run(True, prefix=prefix, requests=reqs)
        cols = run.steps.kv_modality_bytes
        assert None not in cols["image"]
        total = np.sum([cols[m] for m in ("text", "image", "audio")], axis=0)
        assert total.tolist() == run.steps.kv_used_bytes
        assert max(run.steps.kv_shared_bytes) > 0
    # At most the three prompts' images at once, however many samples hold each.
    assert summarize(run)["peak_kv_image_bytes"] <= 3 * 90 * PRESET.kv_bytes_per_token


def test_released_blocks_leave_the_modality_unknown() -> None:
    # Blocks released outside a sliding window: the positions a sequence still counts as
    # written are no longer all held, so the modality of the used bytes is not known.
    from kvbench.engines.kv.paged import PagedPolicy

    preset = get_preset("mistral-7b-v0.1")
    settings = EngineSettings(
        preset=preset, device=parse_device("sim:a100-80gb"),
        kv_bytes=12000 * preset.kv_bytes_per_token, block_size=16, prefix_caching=False,
        scheduler=SchedulerConfig(8192, 8, 2048, True))
    engine = build_engine(engine_config("swa", PagedPolicy(sliding_window_release=True),
                                        settings))
    r = Request("long", 0.0, (Segment("image", 1000, "img"), Segment("text", 4000, "t")), 64)
    run = run_engine(engine, make_workload([r]),
                     VirtualClock(CostModel(preset, settings.device.hardware, 1)))
    assert run.status == "ok", run.error
    cols = run.steps.kv_modality_bytes
    assert cols["image"][0] is not None and None in cols["image"]
    s = summarize(run)
    assert s["peak_kv_image_bytes"] is None and s["peak_kv_text_bytes"] is None
    assert "kv_image_bytes" not in build_curves(run.steps)


def test_modal_pages_shared_by_a_hit_or_a_fork_are_counted_once() -> None:
    # The same image and audio after the same prefix (prefix-cache hits), and forked samples:
    # each shared page of either class is counted once, image and audio apart.
    system = Segment("text", 48, "sys")
    image, audio = Segment("image", 160, "img/same"), Segment("audio", 64, "aud/same",
                                                              seconds=1.28)
    reqs = [Request(f"r{i}", 0.05 * i, (system, image, audio, Segment("text", 8, f"q{i}")),
                    30, n=1 + i % 2) for i in range(4)]
    policy = ModalPolicy(kv_dtype={"text": "float32", "image": "int8", "audio": "int8"})
    settings = _settings(prefix=True)
    run = run_engine(build_engine(engine_config("m", policy, settings)), make_workload(reqs),
                     VirtualClock(CostModel(PRESET, settings.device.hardware, 1)))
    assert run.status == "ok", run.error
    s = summarize(run)
    assert s["prefix_hit_rate"] > 0 and max(run.steps.kv_shared_bytes) > 0
    cols = run.steps.kv_modality_bytes
    assert None not in cols["image"] and None not in cols["audio"]
    # Every request holds the same image and audio pages: at most one copy of each at once
    # (int8 codes, one byte per element), and some step holds both.
    assert max(cols["image"]) == 160 * ELEMENTS and max(cols["audio"]) == 64 * ELEMENTS
