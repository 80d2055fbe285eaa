"""The native CPU decode kernel against the dense oracle and the torch reference, and how the
backend is chosen, built and refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels_reference import Case

from kvbench.errors import KvbenchError
from kvbench.kernels import cpu_native, native_build, reference
from kvbench.kernels.backend import get_backend

# Decodes of one key, of chunk-edge lengths (the kernel takes 64 keys at a time) and long,
# between prefill chunks, whose rows the reference attends.
Q_LENS = [1, 1, 7, 1, 1, 1, 20, 1, 1]
CTX_LENS = [1, 63, 7, 64, 65, 200, 50, 129, 1000]


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    """A machine with a C compiler (every CI machine) must build it: a broken kernel fails
    here rather than falling back unseen."""
    if native_build.compiler() is None:
        pytest.skip("no C compiler")
    cpu_native.library()
    assert get_backend("auto", "cpu").name == "native"


native_only = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler")


def _native(case: Case, layout: str, **kw):
    if layout == "paged":
        return cpu_native.paged_attention(
            case.query, case.paged_k, case.paged_v, case.block_tables, case.context_lens,
            case.cu, case.block_size, case.scale, **kw)
    return cpu_native.contiguous_attention(
        case.query, case.cont_k, case.cont_v, case.extent_starts, case.context_lens, case.cu,
        case.scale, **kw)


def _decode_rows(case: Case) -> torch.Tensor:
    return case.cu[:-1][torch.tensor(case.q_lens) == 1].long()


@native_only
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_matches_dense(layout, block_size, group):
    case = Case(Q_LENS, CTX_LENS, group, block_size, torch.float32, seed=block_size)
    out, lse = _native(case, layout, return_lse=True)
    torch.testing.assert_close(out.double(), case.expected(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, case.paged(return_lse=True)[1], atol=1e-5, rtol=1e-5)


@native_only
@pytest.mark.parametrize("head_dim", [8, 32, 64, 128, 256])
def test_head_sizes(head_dim):
    """Every head size the kernel unrolls or not, against the reference on random pools."""
    gen = torch.Generator().manual_seed(head_dim)
    hkv, group, bs = 2, 2, 16
    ctx = torch.tensor([5, 70, 300], dtype=torch.int32)
    k, v = (torch.randn(64 * bs, hkv, head_dim, generator=gen) for _ in range(2))
    tables = torch.from_numpy(
        np.random.default_rng(0).permutation(64)[:60].reshape(3, 20).astype(np.int32))
    cu = torch.arange(4, dtype=torch.int32)
    q = torch.randn(3, hkv * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    want = reference.paged_attention(q, k, v, tables, ctx, cu, bs, scale)
    got = cpu_native.paged_attention(q, k, v, tables, ctx, cu, bs, scale)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@native_only
def test_paged_and_contiguous_decodes_are_bit_identical():
    """The kernel takes keys in the same order and chunks whatever the layout, so a layout
    comparison compares memory management, not rounding."""
    case = Case(Q_LENS, CTX_LENS, 4, 16, torch.float32, seed=7)
    rows = _decode_rows(case)
    assert torch.equal(_native(case, "paged")[rows], _native(case, "contiguous")[rows])


@native_only
def test_sequences_without_keys_give_zero_rows():
    case = Case([1, 1], [5, 3], 2, 4, torch.float32)
    lens = torch.tensor([0, 3], dtype=torch.int32)
    out, lse = cpu_native.paged_attention(
        case.query, case.paged_k, case.paged_v, case.block_tables, lens, case.cu, 4,
        case.scale, return_lse=True)
    assert not out[0].any() and (lse[0] == float("-inf")).all()
    assert torch.isfinite(lse[1]).all()


@native_only
def test_large_scores_do_not_overflow():
    """Scores far apart (a softmax that is all but one-hot) stay finite and exact."""
    case = Case([1], [130], 1, 16, torch.float32)
    case.query *= 300
    got = _native(case, "paged")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), case.expected(), atol=1e-5, rtol=1e-5)


@native_only
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_one_plan_serves_every_layer_and_carries_on(layout):
    case = Case(Q_LENS, CTX_LENS, 4, 16, torch.float32, seed=2)
    if layout == "paged":
        plan = cpu_native.plan_paged(case.block_tables, case.context_lens, case.cu, 16,
                                     case.paged_k, case.paged_v, case.hq)
        again = cpu_native.plan_paged(case.block_tables, case.context_lens, case.cu, 16,
                                      case.paged_k, case.paged_v, case.hq, previous=plan)
    else:
        plan = cpu_native.plan_contiguous(case.extent_starts, case.context_lens, case.cu,
                                          case.cont_k, case.cont_v, case.hq)
        again = cpu_native.plan_contiguous(case.extent_starts, case.context_lens, case.cu,
                                           case.cont_k, case.cont_v, case.hq, previous=plan)
    assert isinstance(plan, cpu_native.NativePlan) and plan.rest_plan is not None
    want = _native(case, layout, return_lse=True)
    for p in (plan, again):
        got = _native(case, layout, return_lse=True, plan=p)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@native_only
def test_a_plan_for_another_batch_is_refused():
    case = Case(Q_LENS, CTX_LENS, 2, 16, torch.float32)
    plan = cpu_native.plan_paged(case.block_tables, case.context_lens, case.cu, 16,
                                 case.paged_k, case.paged_v, case.hq)
    with pytest.raises(KvbenchError, match="plan made for"):
        cpu_native.paged_attention(case.query, case.paged_k[:-16], case.paged_v[:-16],
                                   case.block_tables, case.context_lens, case.cu, 16,
                                   case.scale, plan=plan)


@pytest.mark.parametrize("what", ["bfloat16", "window", "positions", "head_dim"])
def test_what_the_kernel_does_not_take_goes_to_the_reference(what):
    """Other dtypes, sliding windows, page classes' key positions and head sizes that are not
    a multiple of 8 give exactly the reference's answer."""
    dtype = torch.bfloat16 if what == "bfloat16" else torch.float32
    case = Case(Q_LENS, CTX_LENS, 2, 16, dtype, seed=4)
    kw: dict = {}
    if what == "window":
        kw["window"] = 9
    if what == "positions":
        kw["slot_positions"] = torch.arange(case.paged_k.shape[0], dtype=torch.int32)
        kw["query_positions"] = torch.full((case.query.shape[0],), 10**6, dtype=torch.int32)
    if what == "head_dim":
        case.query, case.paged_k, case.paged_v = (
            x[..., :12].contiguous() for x in (case.query, case.paged_k, case.paged_v))
    plan = cpu_native.plan_paged(case.block_tables, case.context_lens, case.cu, 16,
                                 case.paged_k, case.paged_v, case.hq,
                                 positions="slot_positions" in kw, window=kw.get("window"))
    assert torch.equal(_native(case, "paged", plan=plan, **kw), case.paged(**kw))


def test_without_a_compiler_auto_is_the_reference_and_native_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_native, "compiler", lambda: None)
    cpu_native._load.cache_clear()
    try:
        assert get_backend("auto", "cpu").name == "reference"
        with pytest.raises(KvbenchError, match="needs a C compiler"):
            get_backend("native", "cpu")
    finally:
        cpu_native._load.cache_clear()


def test_a_kernel_that_does_not_compile_is_refused_with_the_compiler_s_message(
        monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("int kvb_decode_attention( {\n")
    monkeypatch.setattr(cpu_native, "SOURCE", broken)
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    if native_build.compiler() is None:
        pytest.skip("no C compiler")
    cpu_native._load.cache_clear()
    try:
        with pytest.raises(KvbenchError, match=r"could not build.*broken\.c"):
            cpu_native.library()
    finally:
        cpu_native._load.cache_clear()
    # Nothing half-written is left to be loaded later.
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_the_built_kernel_is_cached_once(monkeypatch, tmp_path):
    if native_build.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    cc = native_build.compiler()
    name = "k.so"
    first = native_build._build(cc, native_build.FLAG_SETS[-1], name, cpu_native.SOURCE)
    mtime = first.stat().st_mtime_ns
    assert native_build._build(cc, native_build.FLAG_SETS[-1], name, cpu_native.SOURCE) == first
    assert first.stat().st_mtime_ns == mtime
    # The build and the digest it is checked against before every load, in a private folder.
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == [name, f"{name}.sha256"]
    assert (tmp_path / "native").stat().st_mode & 0o777 == 0o700


def test_native_is_refused_off_the_cpu():
    with pytest.raises(KvbenchError, match="runs on the CPU"):
        get_backend("native", "cuda")


@native_only
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decodes_split_among_threads_give_the_same_output(monkeypatch, threads):
    """With more CPU threads the decodes are attended in parts at once, each part on its own
    rows, with the very same arithmetic per row."""
    monkeypatch.setattr(cpu_native, "PARALLEL_MIN_KEYS", 1)
    case = Case(Q_LENS, CTX_LENS, 4, 16, torch.float32, seed=9)
    want = _native(case, "paged", return_lse=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan = cpu_native.plan_paged(case.block_tables, case.context_lens, case.cu, 16,
                                     case.paged_k, case.paged_v, case.hq)
        got = _native(case, "paged", return_lse=True, plan=plan)
    finally:
        torch.set_num_threads(before)
    assert len(plan.parts) == threads
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_run_asking_for_native_without_a_compiler_stops_before_any_engine(monkeypatch,
                                                                           tmp_path):
    from kvbench.run.overrides import RunFlags, resolve_suite
    from kvbench.run.plan import plan_run

    suite, base = resolve_suite("quick-cpu", RunFlags(attention="native", engines="paged"))
    monkeypatch.setattr(cpu_native, "compiler", lambda: None)
    cpu_native._load.cache_clear()
    try:
        with pytest.raises(KvbenchError, match="needs a C compiler"):
            plan_run(suite, base, tmp_path / "out", "test")
    finally:
        cpu_native._load.cache_clear()
    assert not (tmp_path / "out").exists()


@native_only
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_tables_or_extents_outside_the_pool_are_refused(layout):
    """The kernel reads the pool through raw pointers: a table entry or extent past its end is
    refused with an error, before anything is read or written."""
    case = Case([1, 1], [40, 20], 2, 16, torch.float32)
    if layout == "paged":
        case.block_tables[1, 1] = case.paged_k.shape[0] // 16  # one block past the end
    else:
        case.extent_starts[1] = case.cont_k.shape[0] - 19  # its 20 keys end one slot past it
    with pytest.raises(KvbenchError, match="outside the KV pool"):
        _native(case, layout)
    case.block_tables[1, 1], case.extent_starts[1] = -1, -5
    with pytest.raises(KvbenchError, match="outside the KV pool"):
        _native(case, layout)
