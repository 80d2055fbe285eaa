"""The native build cache cannot be hijacked: a shared object planted where kvbench caches its
C builds is never loaded, a cache others can write (or one that cannot be written) is left
alone for a private temporary folder, a compiler that never returns is stopped, and ``auto``
falling back to the reference kernel is said."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_main import cli
from test_kernels_reference import Case

from kvbench.errors import KvbenchError
from kvbench.kernels import cpu_native, native_build, notices
from kvbench.kernels.backend import collected_warnings, get_backend

CC = native_build.compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")
POOL_SOURCE = Path(native_build.__file__).parents[1] / "engines" / "sim" / "replay" / "native.c"
# A library whose constructor runs as soon as it is loaded: it leaves a marker file.
PLANTED_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("constructor ran", f); fclose(f); }
}
int kvb_decode_attention(void) { return 0; }
"""
RUN = ["run", "quick-cpu", "--num-requests", "2", "--engines", "paged", "--clock", "virtual",
       "--cpu-threads", "1"]


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A cache root of the test's own (its ``native`` folder not made yet), with the kernel's
    build and the once-per-process warnings forgotten before and after."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))

    def forget() -> None:
        cpu_native._load.cache_clear()
        notices.warn_once.cache_clear()

    forget()
    yield tmp_path / "cache"
    forget()


@pytest.fixture
def planted(tmp_path: Path) -> tuple[bytes, Path]:
    """The bytes of a hostile shared object and the marker its constructor writes; checked
    to write it when loaded (in another process), so its absence means it never ran."""
    src, so, marker = tmp_path / "planted.c", tmp_path / "planted.so", tmp_path / "marker"
    src.write_text(PLANTED_C)
    subprocess.run([CC, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", so, src],
                   check=True, capture_output=True, timeout=120)
    subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])",
                    so], check=True, timeout=120)
    assert marker.read_text() == "constructor ran"
    marker.unlink()
    return so.read_bytes(), marker


def _plant(data: bytes, *, sidecar: str | None = None) -> list[Path]:
    """``data`` written where the kernel's builds are cached, for every flag set, with a
    digest file holding ``sidecar`` when given."""
    paths = [native_build.cache_file(cpu_native.SOURCE, CC, f) for f in native_build.FLAG_SETS]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(data)
        if sidecar is not None:
            path.with_name(path.name + ".sha256").write_text(sidecar)
    return paths


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _attends_correctly() -> bool:
    """Whether the loaded kernel attends (a planted stand-in writes nothing)."""
    case = Case([1, 1, 1], [5, 70, 130], 2, 16, torch.float32, seed=3)
    got = cpu_native.paged_attention(case.query, case.paged_k, case.paged_v, case.block_tables,
                                     case.context_lens, case.cu, case.block_size, case.scale)
    return torch.allclose(got, case.paged(), atol=1e-5, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize("sidecar", ["missing", "wrong digest"])
def test_a_planted_library_in_a_private_cache_is_rebuilt_never_loaded(cache, planted, sidecar):
    data, marker = planted
    paths = _plant(data, sidecar=None if sidecar == "missing" else _sha(b"other bytes"))
    with collected_warnings() as said:
        lib = cpu_native.library()
    assert not marker.exists()
    assert Path(lib._name) == paths[0] and _attends_correctly()
    rebuilt = paths[0].read_bytes()
    assert rebuilt != data
    assert paths[0].with_name(paths[0].name + ".sha256").read_text().strip() == _sha(rebuilt)
    assert said == []  # a private cache is used, not worked around


@needs_cc
@pytest.mark.parametrize(("where", "mode", "word"), [
    ("native", 0o777, "world-writable"), ("native", 0o770, "group-writable"),
    ("root", 0o757, "world-writable"), ("root", 0o775, "group-writable")])
def test_a_cache_others_can_write_is_refused_for_a_private_temporary_build(
        cache, planted, where, mode, word):
    """Whoever can write the cache (or the folder kvbench made above it) could also write
    the digest: the planted file and its matching digest are left alone, and both C sources
    build in a private temporary folder, said once."""
    data, marker = planted
    paths = _plant(data, sidecar=_sha(data))
    os.chmod(cache / "native" if where == "native" else cache, mode)
    with collected_warnings() as said:
        lib = cpu_native.library()
        pool_lib = native_build.build(POOL_SOURCE, CC)
    assert not marker.exists() and _attends_correctly()
    built = Path(lib._name).parent
    assert built == Path(pool_lib._name).parent != paths[0].parent
    assert stat.S_IMODE(built.stat().st_mode) == 0o700 and built.stat().st_uid == os.geteuid()
    assert [p.read_bytes() for p in paths] == [data, data]  # left as found
    assert len(said) == 1 and word in said[0] and "KVBENCH_CACHE_DIR" in said[0], said


@needs_cc
def test_a_cache_reached_through_a_link_to_a_writable_folder_is_refused(cache, tmp_path,
                                                                       planted):
    data, marker = planted
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    cache.mkdir(mode=0o700)
    (cache / "native").symlink_to(shared)
    _plant(data, sidecar=_sha(data))
    with collected_warnings() as said:
        cpu_native.library()
    assert not marker.exists()
    assert len(said) == 1 and f"{shared} is world-writable" in said[0]


@needs_cc
def test_a_cache_under_a_sticky_shared_folder_is_used(monkeypatch, cache, tmp_path):
    """/tmp-like folders (world-writable, sticky) above a private cache are fine: nobody
    else can rename or remove what lies in them."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(shared / "mine"))
    with collected_warnings() as said:
        lib = cpu_native.library()
    assert said == [] and Path(lib._name).parent == shared / "mine" / "native"
    assert stat.S_IMODE((shared / "mine").stat().st_mode) == 0o700
    assert stat.S_IMODE((shared / "mine" / "native").stat().st_mode) == 0o700


@needs_cc
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_cache_owned_by_someone_else_is_refused(cache, planted, what):
    data, marker = planted
    paths = _plant(data, sidecar=_sha(data))
    for p in [cache / "native"] if what == "folder" else paths:
        os.chown(p, 65534, 65534)
    with collected_warnings() as said:
        cpu_native.library()
    assert not marker.exists()
    assert len(said) == 1 and "owned by uid 65534" in said[0], said


def _stat(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, uid, 0, 0, 0, 0))


@pytest.mark.parametrize(("mode", "owner", "kind", "uid", "refused"), [
    (0o100700, 1000, "file", 1000, None),
    (0o100644, 1000, "file", 1001, "owned by uid 1000"),
    (0o100664, 1000, "file", 1000, "group-writable"),
    (0o100646, 1000, "file", 1000, "world-writable"),
    (0o120777, 1000, "file", 1000, "not a regular file"),
    (0o40700, 0, "folder", 0, None),  # root's cache, owned by root
    (0o40700, 0, "folder", 1000, "owned by uid 0"),
    (0o40755, 0, "above", 1000, None),
    (0o41777, 0, "above", 1000, None),
    (0o40777, 0, "above", 1000, "world-writable"),
    (0o40775, 1000, "above", 1000, "group-writable"),
    (0o41777, 1001, "above", 1000, "owned by uid 1001"),
    (0o100700, 1000, "folder", 1000, "not a folder"),
])
def test_refusal_by_owner_mode_and_kind(mode, owner, kind, uid, refused):
    why = native_build.refusal(_stat(mode, owner), kind, uid)
    assert why is None if refused is None else refused in why


@needs_cc
def test_a_tampered_build_is_rebuilt_and_a_good_one_reused(cache):
    native_build.build(cpu_native.SOURCE, CC)
    path = native_build.cache_file(cpu_native.SOURCE, CC, native_build.FLAG_SETS[0])
    good = path.read_bytes()
    again = path.stat().st_mtime_ns
    native_build.build(cpu_native.SOURCE, CC)
    assert path.stat().st_mtime_ns == again  # verified and loaded, not rebuilt
    # Tampered by replacing the file: writing into it would change the library this process
    # has loaded, under its feet.
    tampered = path.with_name(path.name + ".tampered")
    tampered.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    os.replace(tampered, path)
    native_build.build(cpu_native.SOURCE, CC)
    assert _sha(path.read_bytes()) == path.with_name(path.name + ".sha256").read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


@needs_cc
def test_a_read_only_cache_keeps_its_verified_builds_and_builds_the_rest_elsewhere(cache):
    lib = native_build.build(cpu_native.SOURCE, CC)
    folder = cache / "native"
    os.chmod(folder, 0o500)
    before = sorted(os.listdir(folder))
    with collected_warnings() as said:
        assert native_build.build(cpu_native.SOURCE, CC)._name == lib._name
        assert said == []
        pool_lib = native_build.build(POOL_SOURCE, CC)
    assert Path(pool_lib._name).parent != folder and sorted(os.listdir(folder)) == before
    assert len(said) == 1 and "is read-only" in said[0]


@needs_cc
def test_a_run_with_native_attention_works_from_a_read_only_cache(cache, capsys, monkeypatch,
                                                                  tmp_path):
    """A read-only cache folder used to refuse ``--attention native``."""
    (cache / "native").mkdir(parents=True, mode=0o500)
    kvbench = cli(capsys, monkeypatch)
    code, out = kvbench(*RUN, "--attention", "native", "--out", tmp_path / "out")
    assert code == 0, out
    assert out.count("is read-only") == 1 and "temporary folder" in out
    assert not os.listdir(cache / "native")
    record = json.loads((tmp_path / "out" / "paged.json").read_text())
    assert record["engine_config"]["executor"]["attention"] == "native"


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o700)
    return str(path)


def test_a_compiler_that_never_returns_is_stopped(tmp_path, cache):
    """The compiler and what it started are killed at the timeout; nothing is left."""
    pid_file = tmp_path / "pid"
    hang = _script(tmp_path / "hang-cc", f"sleep 300 &\necho $! > {pid_file}\nwait\n")
    with pytest.raises(native_build.BuildError, match=r"did not finish within 0\.5 s"):
        native_build.build(cpu_native.SOURCE, hang, timeout_s=0.5)
    pid = int(pid_file.read_text())
    for _ in range(100):  # SIGKILL is delivered at once; reaping by init may lag
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the compiler's child {pid} still runs")
    assert not list(cache.rglob("*.so"))


@pytest.fixture
def failing_cc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CC names a compiler that fails every build, as a broken toolchain does."""
    monkeypatch.setenv("CC", _script(tmp_path / "broken-cc",
                                     "echo 'broken-cc: no target for this machine' >&2\n"
                                     "exit 1\n"))


def test_auto_falling_back_to_the_reference_is_warned(cache, failing_cc, capsys, monkeypatch,
                                                      tmp_path):
    kvbench = cli(capsys, monkeypatch)
    code, out = kvbench(*RUN, "--attention", "auto", "--out", tmp_path / "out")
    assert code == 0, out
    assert out.count("--attention auto falls back to the torch reference kernel") == 1, out
    assert "broken-cc: no target for this machine" in out
    record = json.loads((tmp_path / "out" / "paged.json").read_text())
    assert record["engine_config"]["executor"]["attention"] == "reference"


def test_native_with_a_failing_compiler_is_refused_with_what_to_do(cache, failing_cc, capsys,
                                                                   monkeypatch, tmp_path):
    kvbench = cli(capsys, monkeypatch)
    code, out = kvbench(*RUN, "--attention", "native", "--out", tmp_path / "out")
    assert code == 2 and "Traceback" not in out, out
    assert "could not build the native attention kernel" in out
    assert "broken-cc: no target" in out and "--attention reference" in out
    with pytest.raises(KvbenchError, match="could not build"):
        get_backend("native", "cpu")


def test_auto_outside_a_run_says_so_once_on_stderr(cache, failing_cc, capsys):
    for _ in range(3):
        assert get_backend("auto", "cpu").name == "reference"
    err = capsys.readouterr().err
    assert err.count("warning: --attention auto falls back") == 1, err
    assert "broken-cc" in cpu_native.unavailable_reason()


@needs_cc
def test_the_simulators_c_helpers_build_without_torch(cache):
    """The replay's pool, the tiers' key queues and the oracle build and load through
    ``native_build`` in a process that never imports torch (nor the attention kernel)."""
    probe = (
        "import sys\n"
        "from kvbench.engines.kv import key_queue, oracle\n"
        "from kvbench.engines.sim.replay import pool\n"
        "assert pool._library() and key_queue._library() and oracle._library()\n"
        "print(sorted(m for m in ('torch', 'kvbench.kernels.cpu_native') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
