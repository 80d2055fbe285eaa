"""Contiguous KV manager: arena invariants under random operations, placement, compaction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_driver import KVDriver, make_seq

from kvbench.engines.kv.contiguous import ContiguousKVManager
from kvbench.errors import KvbenchError
from kvbench.workloads.model import Request, Segment

BPT = 8  # bytes per token


def contiguous(capacity: int = 100, **kw) -> ContiguousKVManager:
    kw.setdefault("reservation", "request")
    return ContiguousKVManager(capacity, BPT, kw.pop("max_model_len", 64), **kw)


def check_invariants(kv: ContiguousKVManager, driver: KVDriver) -> None:
    extents = [*kv._extents.values(), *(e for s in kv._spare.values() for e in s)]
    pieces = sorted([(e.start, e.length) for e in extents] + kv.arena.holes)
    cursor = 0
    for start, length in pieces:  # extents and holes tile the arena exactly
        assert start == cursor and length > 0
        cursor += length
    assert cursor == kv.capacity_tokens
    for seq in driver.running:
        assert kv._extents[seq.seq_id].num_committed == seq.num_computed_tokens
    s = kv.stats()
    assert s.free_bytes + s.reserved_bytes == s.capacity_bytes
    assert 0 <= s.used_bytes <= s.reserved_bytes <= s.capacity_bytes
    assert s.used_bytes == sum(e.num_committed for e in extents) * BPT
    assert s.reserved_bytes == sum(e.length for e in extents) * BPT
    ahead = sum(min(e.length, e.final_len) - e.num_committed for e in extents)
    assert 0 <= s.reserved_ahead_bytes == ahead * BPT <= s.reserved_bytes - s.used_bytes
    assert s.largest_free_bytes == max((n for _, n in kv.arena.holes), default=0) * BPT
    assert s.block_allocs - s.block_frees == len(extents) == s.page_table_entries
    assert all(e.length % kv.align_slots == 0 for e in extents)
    if kv.auto_defrag is not None and s.free_bytes:  # compacted whenever it fell below
        assert s.largest_free_bytes >= kv.auto_defrag * s.free_bytes
    driver.check_contents()


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    capacity=st.integers(8, 120),
    max_model_len=st.integers(16, 48),
    reservation=st.sampled_from(["max_model_len", "request", "pow2"]),
    fit=st.sampled_from(["first", "best"]),
    compaction=st.booleans(),
    auto_defrag=st.sampled_from([None, None, 0.5, 1.0]),
    align=st.sampled_from([1, 1, 4]),
    seed=st.integers(0, 2**16),
)
def test_random_operations_keep_invariants(
    data, capacity, max_model_len, reservation, fit, compaction, auto_defrag, align, seed
):
    kv = ContiguousKVManager(capacity, BPT, max_model_len, reservation, fit, compaction,
                             auto_defrag=auto_defrag, align_slots=align)
    d = KVDriver(kv, seed)
    waiting = []
    for i in range(data.draw(st.integers(1, 60), label="ops")):
        op = data.draw(st.sampled_from(["new", "admit", "admit", "step", "step", "preempt"]))
        if op == "new":
            prompt, output = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 8))
            waiting.append(make_seq(i, prompt, output, n=data.draw(st.integers(1, 3))))
        elif op == "admit" and waiting:
            # Any waiting sequence, not only the oldest: more varied hole patterns.
            seq = data.draw(st.sampled_from(waiting))
            if kv.never_fits(seq.request) is not None or d.admit(
                seq, data.draw(st.integers(1, 16))
            ):
                waiting.remove(seq)
        elif op == "step" and d.running:
            seq = data.draw(st.sampled_from(d.running))
            assert d.step(seq, data.draw(st.integers(1, 16)))
        elif op == "preempt" and d.running:
            seq = data.draw(st.sampled_from(d.running))
            d.preempt(seq)
            waiting.append(seq)
        check_invariants(kv, d)
    for seq in list(d.running):
        d.free(seq)
    check_invariants(kv, d)
    s = kv.stats()
    assert s.free_bytes == s.largest_free_bytes == s.capacity_bytes and s.used_bytes == 0
    assert kv.arena.holes == [(0, capacity)]


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    sizes=st.lists(st.integers(3, 12), min_size=2, max_size=10),
    fit=st.sampled_from(["first", "best"]),
)
def test_compaction_admits_whatever_fits_in_total(data, sizes, fit):
    kv = contiguous(sum(sizes) + data.draw(st.integers(0, 5)), fit=fit, compaction=True)
    d = KVDriver(kv)
    seqs = [make_seq(i, size - 2, 2) for i, size in enumerate(sizes)]  # extent = size
    for seq in seqs:
        assert d.admit(seq, data.draw(st.integers(1, 12)))  # part of the prompt written
    for seq in data.draw(st.lists(st.sampled_from(seqs), unique=True)):
        d.free(seq)
    free = kv.stats().free_bytes // BPT
    need = data.draw(st.integers(2, max(free, 2)))
    assert d.admit(make_seq(99, need - 1, 1), 1) == (need <= free)
    check_invariants(kv, d)


def fill(kv: ContiguousKVManager, sizes: list[int]) -> list:
    """Admit one sequence per size (prompt + output = size) back to back."""
    seqs = []
    for i, size in enumerate(sizes):
        seq = make_seq(i, size - 1, 1)
        assert kv.allocate(seq, 0, 1)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize(("fit", "start"), [("first", 10), ("best", 50)])
def test_first_fit_and_best_fit_placement(fit, start):
    kv = contiguous(100, fit=fit)
    seqs = fill(kv, [10, 30, 10, 20, 10])
    kv.free(seqs[1])
    kv.free(seqs[3])
    assert kv.arena.holes == [(10, 30), (50, 20), (80, 20)]
    new = make_seq(9, 14, 1)
    assert kv.allocate(new, 0, 1)
    assert kv.extent(new) == (start, 15)
    assert kv.stats().largest_free_bytes == (20 if fit == "first" else 30) * BPT


def test_free_coalesces_holes():
    kv = contiguous(100)
    seqs = fill(kv, [10, 10, 10])
    kv.free(seqs[0])
    kv.free(seqs[2])
    assert kv.arena.holes == [(0, 10), (20, 80)]
    kv.free(seqs[1])
    assert kv.arena.holes == [(0, 100)]


def test_no_fit_without_compaction_waits():
    kv = contiguous(60)
    seqs = fill(kv, [10] * 6)
    for s in seqs[1::2]:
        kv.free(s)
    before = kv.stats()
    assert not kv.allocate(make_seq(9, 24, 1), 0, 1)
    assert kv.stats() == before and kv.stats().free_bytes == 30 * BPT


def test_compaction_makes_one_hole_and_moves_preserve_data():
    kv = contiguous(60, compaction=True)
    d = KVDriver(kv)
    seqs = [make_seq(i, 8, 2) for i in range(6)]  # 10-token extents, 8 tokens written each
    for s in seqs:
        assert d.admit(s, 100)
    for s in seqs[0::2]:  # holes at 0, 20 and 40, 10 tokens each
        d.free(s)
    big = make_seq(9, 24, 1)
    assert d.admit(big, 3)
    assert [kv.extent(s)[0] for s in seqs[1::2]] == [0, 10, 20]
    assert kv.extent(big) == (30, 25)
    assert kv.arena.holes == [(55, 5)]
    assert kv.stats().copied_bytes == 3 * 8 * BPT
    d.check_contents()  # the queued moves, applied in order, kept every sequence's KV


def test_compaction_move_may_overlap_its_source():
    kv = contiguous(40, compaction=True)
    d = KVDriver(kv)
    a, b = make_seq(1, 3, 2), make_seq(2, 19, 2)  # extents [0, 5) and [5, 26)
    assert d.admit(a, 100) and d.admit(b, 100)
    d.free(a)
    big = make_seq(3, 18, 1)  # 19 tokens: more than either hole, all the free space
    assert kv.allocate(big, 0, 1)
    (move,) = kv.take_copies()
    assert (move.src, move.dst, move.num_slots) == (5, 0, 19)
    d.mem[move.dst : move.dst + move.num_slots] = d.mem[move.src : move.src + move.num_slots].copy()
    assert kv.extent(b) == (0, 21) and kv.extent(big) == (21, 19)
    d.check_contents()


def test_pow2_and_max_model_len_reservations():
    kv = contiguous(1000, reservation="pow2", max_model_len=100)
    assert [kv.reserve_len(n) for n in (1, 2, 5, 8, 9, 64, 65)] == [1, 2, 8, 8, 16, 64, 100]
    assert contiguous(reservation="max_model_len", max_model_len=48).reserve_len(3) == 48
    assert contiguous(reservation="request").reserve_len(37) == 37


def test_parallel_samples_reserve_together_and_fork_copies():
    kv = contiguous(100)
    d = KVDriver(kv)
    parent = make_seq(1, 9, 3, n=3)  # 12-token extents
    assert d.admit(parent, 4)
    assert kv.stats().reserved_bytes == 3 * 12 * BPT
    assert d.step(parent, 100)  # prefill done: samples, forks two children
    assert len(d.running) == 3
    assert kv.stats().copied_bytes == 2 * 9 * BPT
    assert kv.stats().used_bytes == 3 * 9 * BPT
    d.check_contents()
    assert not kv.allocate(make_seq(2, 29, 3, n=3), 0, 1)  # 3 x 32 > 64 free
    for s in list(d.running):
        d.free(s)
    assert kv.stats().free_bytes == kv.stats().capacity_bytes


def test_preempted_before_prefill_releases_unforked_extents():
    kv = contiguous(100)
    d = KVDriver(kv)
    parent = make_seq(1, 9, 3, n=2)
    assert d.admit(parent, 4)
    d.preempt(parent)
    assert kv.stats().reserved_bytes == 0 and kv.stats().block_frees == 2


def test_grow_past_the_extent_is_a_bug():
    kv = contiguous(100)
    seq = make_seq(1, 5, 2)  # a 7-token extent
    assert kv.allocate(seq, 0, 5)
    seq.num_computed_tokens = 5
    kv.commit(seq)
    assert kv.grow(seq, 2)
    with pytest.raises(RuntimeError):
        kv.grow(seq, 3)


def test_never_fits_says_why_and_what_to_do():
    kv = contiguous(100, reservation="max_model_len", max_model_len=64)
    req = Request("a", 0.0, (Segment("text", 60, "k"),), 8)
    assert "max_model_len is 64" in kv.never_fits(req)
    req = Request("b", 0.0, (Segment("text", 10, "k"),), 8, n=2)
    msg = kv.never_fits(req)
    assert "2 samples x 64 tokens" in msg and "--kv-memory" in msg
    assert kv.never_fits(Request("c", 0.0, (Segment("text", 10, "k"),), 8)) is None
    with pytest.raises(KvbenchError):
        contiguous(reservation="exact")


def test_auto_defrag_compacts_when_a_free_leaves_the_index_below_the_threshold():
    kv = contiguous(60, auto_defrag=0.9)
    d = KVDriver(kv)
    seqs = [make_seq(i, 8, 2) for i in range(6)]  # 10-token extents, 8 tokens written each
    for s in seqs:
        assert d.admit(s, 100)
    d.free(seqs[0])  # one hole at 0 (index 1.0): nothing to do
    assert kv.stats().copied_bytes == 0 and kv.arena.holes == [(0, 10)]
    d.free(seqs[2])  # holes at 0 and 20: index 0.5 < 0.9, so everything slides left
    assert kv.arena.holes == [(40, 20)]
    assert kv.stats().copied_bytes == 4 * 8 * BPT  # the four extents above the first hole
    d.check_contents()


def test_alignment_rounds_extents_up_and_the_rounding_is_internal_waste():
    kv = contiguous(100, align_slots=8)
    d = KVDriver(kv)
    seq = make_seq(1, 9, 2)  # 11 tokens: an extent of 16
    assert d.admit(seq, 100)
    assert kv.extent(seq) == (0, 16)
    s = kv.stats()
    assert s.reserved_bytes == 16 * BPT
    # 9 written, 1 to come (the last sampled token gets no KV), 6 never: internal waste.
    assert s.reserved_ahead_bytes == 1 * BPT and s.used_bytes == 9 * BPT


def test_alignment_unit_is_one_layers_k_or_v_per_token_on_a_rank():
    from kvbench.engines.builtin.scheduler import SchedulerConfig
    from kvbench.engines.config import EngineSettings, engine_config
    from kvbench.engines.kv.contiguous import ContiguousPolicy
    from kvbench.engines.model.presets import get_preset
    from kvbench.run.devices import parse_device

    def slots(align: int, model: str = "llama-3-8b") -> int:
        settings = EngineSettings(
            preset=get_preset(model), device=parse_device("sim:a100-80gb"), kv_bytes=1 << 30,
            block_size=16, prefix_caching=False, scheduler=SchedulerConfig(max_model_len=4096),
        )
        policy = ContiguousPolicy(align_bytes=align)
        return policy.align_slots(engine_config("c", policy, settings))

    # Llama-3-8B: 8 KV heads x 128 x 2 B = 2 KiB a token per layer and K/V, so 128 B
    # alignment (the reports' C4) never rounds anything; 2 MiB rounds to 1024 tokens.
    assert slots(128) == 1 and slots(2 << 20) == 1024 and slots(3072) == 3


def test_auto_defrag_also_compacts_when_an_admission_shrinks_the_largest_hole():
    kv = contiguous(60, auto_defrag=0.6)
    d = KVDriver(kv)
    seqs = [make_seq(i, 8, 2) for i in range(6)]  # six 10-token extents
    for s in seqs:
        assert d.admit(s, 100)
    for s in (seqs[0], seqs[1], seqs[4]):
        d.free(s)  # holes [0, 20) and [40, 50): index 20 / 30, above 0.6
    assert kv.arena.holes == [(0, 20), (40, 10)] and kv.stats().copied_bytes == 0
    assert d.admit(make_seq(9, 11, 1), 1)  # 12 tokens from [0, 20): index 10 / 18
    assert len(kv.arena.holes) == 1 and kv.stats().copied_bytes > 0
    d.check_contents()
