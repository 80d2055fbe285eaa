"""The ``native`` CPU backend: decodes attended by a C kernel that reads the KV pool in place.

Every decode of a step (a sequence with one query row) is attended in one call per layer of
``cpu_decode.c``, which walks each sequence's block table (or extent) over the pool, with no
gathered copy and no per-sequence call from Python; this is how vLLM's CPU attention reads its
paged cache. Prefill chunks, quantised or non-float32 caches, key positions (page classes) and
sliding windows go to the torch reference (:mod:`kvbench.kernels.reference`), whose
signatures this backend keeps; so do the KV store, slot copies and merges.

The kernel is compiled on first use with the machine's C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) for this CPU, within :data:`BUILD_TIMEOUT_S`, and cached under
``$KVBENCH_CACHE_DIR`` (default ``$XDG_CACHE_HOME/kvbench``, else ``~/.cache/kvbench``) by a
hash of its source, flags, compiler and CPU. Code loaded into this process must not be
writable by anyone else: the cache folder is made 0700, it and every folder above it are
checked (owner, mode), and a cached build is loaded only when its SHA-256 matches the one
recorded when it was built. A cache that fails a check, or cannot be written, is left alone
and the build goes to a private temporary folder instead (said once). Without a compiler
the backend is refused with a message, and ``auto`` uses the reference.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import itertools
import os
import platform
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.kernels import reference
from kvbench.kernels.notices import warn_once
from kvbench.kernels.reference_plan import AttentionPlan

SOURCE = Path(__file__).with_name("cpu_decode.c")
# Tried in order: tuned for this CPU's vector units, then plain -O3 for a compiler that does
# not know -march=native.
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))
# A build took about 1 s; a CC that never returns must not hang the run.
BUILD_TIMEOUT_S = 120.0


def compiler() -> str | None:
    """The C compiler the kernel is built with, or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def cache_dir() -> Path:
    root = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvbench")
    return Path(root) / "native"


def library() -> ctypes.CDLL:
    """The compiled kernel, built once per source, flags, compiler and CPU (raises
    :class:`KvbenchError` saying why it cannot be)."""
    lib = _load()
    if isinstance(lib, str):
        raise KvbenchError(f"{lib}; or use --attention reference")
    return lib


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built and loaded here, or None when it can."""
    lib = _load()
    return lib if isinstance(lib, str) else None


@cache
def _load() -> ctypes.CDLL | str:
    """The kernel, or why it cannot be built (tried once per process)."""
    cc = compiler()
    if cc is None:
        return "the native attention kernel needs a C compiler (set CC, or install gcc or clang)"
    try:
        return _bind(build(SOURCE, cc))
    except BuildError as e:
        return f"could not build the native attention kernel ({e})"


class BuildError(Exception):
    """A C source that did not build or load with any flag set (what the compiler said), or
    a compiler that did not finish in time."""


def cache_file(source: Path, cc: str, flags: tuple[str, ...]) -> Path:
    """Where the build of ``source`` with ``cc`` and ``flags`` for this CPU is cached."""
    key = hashlib.sha256(b"\0".join(
        [source.read_bytes(), " ".join(flags).encode(), cc.encode(),
         _cpu_identity().encode()]))
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, cc: str, timeout_s: float = BUILD_TIMEOUT_S) -> ctypes.CDLL:
    """``source`` compiled with ``cc`` for this machine, by the first of :data:`FLAG_SETS`
    that works, and loaded; built once per source, flags, compiler and CPU. A compiler
    that runs past ``timeout_s`` is killed and raises :class:`BuildError`."""
    errors = []
    for flags in FLAG_SETS:
        name = cache_file(source, cc, flags).name
        try:
            return ctypes.CDLL(str(_build(cc, flags, name, source, timeout_s)))
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            errors.append(f"{cc} {' '.join(flags)}: {detail.strip()}")
    raise BuildError("; ".join(errors))


# A C function's result type and argument types, for ctypes.
Signature = tuple[Any, list[Any]]


def optional_library(source: Path, signatures: dict[str, Signature]) -> ctypes.CDLL | None:
    """``source`` built and loaded as :func:`build` does, its functions typed by
    ``signatures``, or None where there is no compiler or the build fails (for C that only
    speeds up what Python also does)."""
    cc = compiler()
    if cc is None:
        return None
    try:
        lib = build(source, cc)
    except BuildError:
        return None
    for name, (restype, argtypes) in signatures.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, argtypes
    return lib


def _build(cc: str, flags: tuple[str, ...], name: str, source: Path,
           timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """The path of a verified build ``name`` of ``source``, compiled now if need be: in the
    cache when it passes its checks, else in a private temporary folder (said once)."""
    folder, why = _open_cache(cache_dir())
    path = folder / name
    if why is None and (why := _file_refusal(path)) is None and (
            _verified(path) or (why := _compile_into(cc, flags, source, path, timeout_s)) is None):
        return path
    path = _fallback_folder(folder, why) / name
    if not _verified(path) and (failed := _compile_into(cc, flags, source, path, timeout_s)):
        raise OSError(failed)
    return path


def refusal(st: os.stat_result, kind: Literal["file", "folder", "above"],
            uid: int | None = None) -> str | None:
    """Why a cached ``file``, the cache ``folder`` or a folder ``above`` it, whose status is
    ``st``, must not be trusted with code this process loads (None when it may): someone
    other than ``uid`` (default: this process's user) could change what is loaded. Folders
    above may also be root's, and world-writable when sticky (as /tmp is)."""
    uid = os.geteuid() if uid is None else uid
    if not (stat.S_ISREG if kind == "file" else stat.S_ISDIR)(st.st_mode):
        return "not a regular file" if kind == "file" else "not a folder"
    if st.st_uid != uid and not (kind == "above" and st.st_uid == 0):
        return f"owned by uid {st.st_uid}, not by this user (uid {uid})"
    if kind == "above" and st.st_mode & stat.S_ISVTX:
        return None  # entries of others' cannot be renamed or removed in a sticky folder
    if st.st_mode & stat.S_IWOTH:
        return "world-writable"
    if st.st_mode & stat.S_IWGRP:
        return "group-writable"
    return None


def _open_cache(folder: Path) -> tuple[Path, str | None]:
    """``folder`` as a path without links, made if missing (0700, as is each folder above it
    that is made), and why it must not be used (None when it may)."""
    real = Path(os.path.realpath(folder))
    for p in reversed((real, *real.parents)):
        if not os.path.lexists(p):
            try:
                os.mkdir(p, 0o700)
            except FileExistsError:
                pass  # made meanwhile by another process: checked below like any other
            except OSError as e:
                return real, f"{p} cannot be made ({e.strerror})"
    for p in (real, *real.parents):
        try:
            why = refusal(os.lstat(p), "folder" if p == real else "above")
        except OSError as e:
            why = f"not readable ({e.strerror})"
        if why is not None:
            return real, f"{p} is {why}"
    return real, None


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _file_refusal(path: Path) -> str | None:
    """Why the cached build at ``path`` or its recorded digest must not be used (None when
    they may, or are missing)."""
    for p in (path, _sidecar(path)):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if (why := refusal(st, "file")) is not None:
            return f"{p} is {why}"
    return None


def _sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _verified(path: Path) -> bool:
    """Whether ``path`` holds the very bytes whose digest was recorded when it was built.
    Called only inside a folder that passed :func:`_open_cache` (or this process's own
    temporary one): nobody else can swap the file between this check and the load."""
    try:
        return _sidecar(path).read_text().strip() == _sha256(path)
    except (OSError, UnicodeDecodeError):
        return False


def _compile_into(cc: str, flags: tuple[str, ...], source: Path, path: Path,
                  timeout_s: float) -> str | None:
    """Compile ``source`` to ``path`` (atomically: a finished file or none), then record its
    digest beside it; or say why its folder cannot be written."""
    if not os.stat(path.parent).st_mode & stat.S_IWUSR:
        return f"{path.parent} is read-only"  # chosen by its owner: honoured even by root
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".so")
    except OSError as e:
        return f"{path.parent} cannot be written ({e.strerror})"
    os.close(fd)
    try:
        _run_compiler([cc, *flags, "-shared", "-fPIC", "-o", tmp, str(source), "-lm"],
                      timeout_s)
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, which may let others write
        digest = _sha256(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    write_text_atomic(_sidecar(path), digest + "\n")
    return None


def _run_compiler(cmd: list[str], timeout_s: float) -> None:
    """Run ``cmd`` in a process group of its own; past ``timeout_s`` the whole group (the
    compiler's assembler and linker too) is killed and the build fails."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException as e:
            # In a session of its own, the compiler's group hears no Ctrl-C: stop it here.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise BuildError(
                    f"{cmd[0]} did not finish within {timeout_s:g} s and was stopped; check "
                    "that CC names a working C compiler") from None
            raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)


@cache
def _temp_folder() -> Path:
    """This process's private (0700) build folder, removed when it exits."""
    path = Path(tempfile.mkdtemp(prefix="kvbench-native-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def _fallback_folder(cache: Path, why: str) -> Path:
    """The temporary build folder, used because the cache ``cache`` cannot be (``why``)."""
    temp = _temp_folder()
    warn_once(
        f"the native build cache {cache} is not used: {why}; building in the private "
        f"temporary folder {temp} for this process only (make the cache yours alone and "
        "writable, e.g. chmod 700, or set KVBENCH_CACHE_DIR to a folder only you can write)")
    return temp


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvb_decode_attention.restype = ctypes.c_int
    lib.kvb_decode_attention.argtypes = [
        ptr, i64, i64,                 # query and its row, head strides
        ptr, ptr, i64, i64,            # k, v caches, their slot stride and slots
        i64, ptr, ptr, ptr,            # n, seqs, rows, context_lens
        ptr, i64, i64,                 # block tables, their row stride, block size
        ptr,                           # extent starts
        i64, i64, i64, ctypes.c_float,  # Hq, Hkv, D, scale
        ptr, ptr,                      # out, lse
    ]
    return lib


def available() -> bool:
    """Whether the kernel builds and loads here."""
    return unavailable_reason() is None


@dataclass(frozen=True, slots=True)
class NativePlan:
    """One step's split: the decodes (sequence indices, their query rows, int64) for the C
    kernel, in ``parts`` of about equal keys, one per CPU thread; the other sequences (their
    query rows, their layout's rows, context lengths and ``cu_seqlens_q``) with the
    reference's ``rest_plan`` of them (all None when there are none)."""

    num_rows: int
    num_slots: int
    parts: tuple[tuple[Tensor, Tensor], ...]
    rest_rows: Tensor | slice | None = None
    rest_layout: Tensor | None = None
    rest_lens: Tensor | None = None
    rest_cu: Tensor | None = None
    rest_plan: AttentionPlan | None = None


# Decodes are split among torch's CPU threads only when they read this many keys or more.
# Measured on a 2-core VM (64 decodes, tiny's heads): the hand-off to a second thread costs
# 100-150 us, as much as attending 8,192 keys (207 us on one thread, 214 us on two); at
# 16,384 keys two threads take 305 us against 428 us.
PARALLEL_MIN_KEYS = 16384


def _split(layout: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor, num_slots: int
           ) -> NativePlan:
    """The decodes in parts and the other sequences of ``layout`` (tables or extents), no
    ``rest_plan`` yet."""
    cu = cu_seqlens_q.cpu().numpy().astype(np.int64)
    lens = np.diff(cu)
    dec = np.flatnonzero(lens == 1)
    other = np.flatnonzero(lens != 1)
    rest: dict[str, Any] = {}
    if other.size:
        rows = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in other])
        # Usually the prefill chunks' rows are one run: a view rather than a copy.
        contiguous = rows.size and rows[-1] - rows[0] + 1 == rows.size
        index = torch.from_numpy(other)
        rest = dict(
            rest_rows=(slice(int(rows[0]), int(rows[-1]) + 1) if contiguous
                       else torch.from_numpy(rows)),
            rest_layout=layout[index], rest_lens=context_lens[index],
            rest_cu=torch.from_numpy(np.concatenate([[0], np.cumsum(lens[other])])
                                     .astype(np.int32)))
    keys = np.cumsum(context_lens.cpu().numpy()[dec], dtype=np.int64)
    threads = min(torch.get_num_threads(), dec.size)
    cuts = [0, dec.size]
    if threads > 1 and keys.size and keys[-1] >= PARALLEL_MIN_KEYS:
        cuts[1:1] = np.searchsorted(keys, keys[-1] * np.arange(1, threads) / threads).tolist()
    parts = tuple((torch.from_numpy(dec[a:b]), torch.from_numpy(cu[dec[a:b]]))
                  for a, b in itertools.pairwise(cuts) if b > a)
    return NativePlan(int(cu[-1]), num_slots, parts, **rest)


def _cache_ok(k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the C kernel reads caches like these: float32 on the CPU, a slot's heads and
    their D floats packed, D a multiple of 8 up to 256."""
    d = k_cache.shape[-1]
    return (k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
            and k_cache.stride(-2) == d and d % 8 == 0 and d <= 256)


def _native_ok(query: Tensor, k_cache: Tensor, v_cache: Tensor, options: dict[str, Any]) -> bool:
    """Whether the C kernel can take this call's decodes."""
    return (_cache_ok(k_cache, v_cache) and query.dtype == torch.float32
            and query.stride(-1) == 1
            and all(options.get(k) is None
                    for k in ("k_scale", "v_scale", "slot_positions", "window")))


def plan_paged(block_tables: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor,
               block_size: int, k_cache: Tensor, v_cache: Tensor, num_heads: int, *,
               positions: bool = False, window: int | None = None,
               previous: Any = None) -> NativePlan | AttentionPlan:
    """As :func:`reference.plan_paged`; the reference plans what the kernel does not take."""

    def ref(tables: Tensor, lens: Tensor, cu: Tensor, **kw: Any) -> AttentionPlan:
        return reference.plan_paged(tables, lens, cu, block_size, k_cache, v_cache, num_heads,
                                    **kw)

    return _plan(ref, block_tables, context_lens, cu_seqlens_q, k_cache, v_cache, positions,
                 window, previous)


def plan_contiguous(extent_starts: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor,
                    k_cache: Tensor, v_cache: Tensor, num_heads: int, *,
                    positions: bool = False, window: int | None = None,
                    previous: Any = None) -> NativePlan | AttentionPlan:
    """As :func:`reference.plan_contiguous` (see :func:`plan_paged`)."""

    def ref(starts: Tensor, lens: Tensor, cu: Tensor, **kw: Any) -> AttentionPlan:
        return reference.plan_contiguous(starts, lens, cu, k_cache, v_cache, num_heads, **kw)

    return _plan(ref, extent_starts, context_lens, cu_seqlens_q, k_cache, v_cache, positions,
                 window, previous)


def _plan(ref: Callable[..., AttentionPlan], layout: Tensor, context_lens: Tensor,
          cu_seqlens_q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: bool,
          window: int | None, previous: Any) -> NativePlan | AttentionPlan:
    """The plan of a layout (its tables or extents) whose reference planner is ``ref``."""
    previous = _reference_plan(previous)
    if positions or window is not None or not _cache_ok(k_cache, v_cache):
        return ref(layout, context_lens, cu_seqlens_q, positions=positions, window=window,
                   previous=previous)
    plan = _split(layout, context_lens, cu_seqlens_q, k_cache.shape[0])
    if plan.rest_layout is None:
        return plan
    return replace(plan, rest_plan=ref(plan.rest_layout, plan.rest_lens, plan.rest_cu,
                                       previous=previous))


def _reference_plan(previous: Any) -> AttentionPlan | None:
    if isinstance(previous, NativePlan):
        return previous.rest_plan
    return previous if isinstance(previous, AttentionPlan) else None


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    context_lens: Tensor, cu_seqlens_q: Tensor, block_size: int, scale: float,
                    **options: Any) -> Tensor | tuple[Tensor, Tensor]:
    """As :func:`reference.paged_attention`."""
    plan = options.pop("plan", None)
    if isinstance(plan, AttentionPlan) or not _native_ok(query, k_cache, v_cache, options):
        return reference.paged_attention(
            query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, block_size,
            scale, plan=plan if isinstance(plan, AttentionPlan) else None, **options)
    if not isinstance(plan, NativePlan):
        plan = plan_paged(block_tables, context_lens, cu_seqlens_q, block_size, k_cache,
                          v_cache, query.shape[1])
    assert isinstance(plan, NativePlan)

    def rest(q: Tensor, plan: NativePlan, **kw: Any) -> Any:
        return reference.paged_attention(q, k_cache, v_cache, plan.rest_layout, plan.rest_lens,
                                         plan.rest_cu, block_size, scale, plan=plan.rest_plan,
                                         **kw)

    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    return _attend(query, k_cache, v_cache, context_lens, scale, plan, options, rest,
                   tables=tables.contiguous(), block_size=block_size)


def contiguous_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor,
                         extent_starts: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor,
                         scale: float, **options: Any) -> Tensor | tuple[Tensor, Tensor]:
    """As :func:`reference.contiguous_attention`."""
    plan = options.pop("plan", None)
    if isinstance(plan, AttentionPlan) or not _native_ok(query, k_cache, v_cache, options):
        return reference.contiguous_attention(
            query, k_cache, v_cache, extent_starts, context_lens, cu_seqlens_q, scale,
            plan=plan if isinstance(plan, AttentionPlan) else None, **options)
    if not isinstance(plan, NativePlan):
        plan = plan_contiguous(extent_starts, context_lens, cu_seqlens_q, k_cache, v_cache,
                               query.shape[1])
    assert isinstance(plan, NativePlan)

    def rest(q: Tensor, plan: NativePlan, **kw: Any) -> Any:
        return reference.contiguous_attention(q, k_cache, v_cache, plan.rest_layout,
                                              plan.rest_lens, plan.rest_cu, scale,
                                              plan=plan.rest_plan, **kw)

    starts = extent_starts if extent_starts.dtype == torch.int64 else extent_starts.long()
    return _attend(query, k_cache, v_cache, context_lens, scale, plan, options, rest,
                   starts=starts.contiguous())


@cache
def _workers(n: int) -> ThreadPoolExecutor:
    """Threads that take the decodes' other parts (one pool per count, made when first used)."""
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvbench-attention")


def _attend(query: Tensor, k_cache: Tensor, v_cache: Tensor, context_lens: Tensor,
            scale: float, plan: NativePlan, options: dict[str, Any], rest: Any, *,
            tables: Tensor | None = None, block_size: int = 0,
            starts: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    if (plan.num_rows, plan.num_slots) != (query.shape[0], k_cache.shape[0]):
        raise KvbenchError(
            f"attention plan made for (rows, slots) {(plan.num_rows, plan.num_slots)}, used "
            f"with {(query.shape[0], k_cache.shape[0])}")
    return_lse = bool(options.get("return_lse"))
    rows, hq, d = query.shape
    out = torch.empty(query.shape, dtype=torch.float32)
    lse = torch.empty(rows, hq) if return_lse else None
    if plan.parts:
        ctx = context_lens if context_lens.dtype == torch.int32 else context_lens.int()
        ctx = ctx.contiguous()
        kernel = library().kvb_decode_attention

        def attend(seqs: Tensor, rows: Tensor) -> None:
            rc = kernel(
                query.data_ptr(), query.stride(0), query.stride(1),
                k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.shape[0],
                seqs.shape[0], seqs.data_ptr(), rows.data_ptr(), ctx.data_ptr(),
                tables.data_ptr() if tables is not None else None,
                tables.stride(0) if tables is not None else 0, block_size,
                starts.data_ptr() if starts is not None else None,
                hq, k_cache.shape[1], d, scale,
                out.data_ptr(), lse.data_ptr() if lse is not None else None)
            if rc == -1:
                raise MemoryError("the native attention kernel could not allocate its buffers")
            if rc == -3:
                raise KvbenchError(
                    "a block table or extent of a decode reaches outside the KV pool "
                    f"({k_cache.shape[0]} slots)")
            assert rc == 0, f"native attention kernel returned {rc}"

        # ctypes lets go of the GIL during the call: the parts run at once, on their own rows.
        others = [_workers(len(plan.parts) - 1).submit(attend, *p) for p in plan.parts[1:]]
        attend(*plan.parts[0])
        for f in others:
            f.result()
    if plan.rest_rows is not None:
        sel = plan.rest_rows
        q = query[sel] if isinstance(sel, slice) else query.index_select(0, sel)
        got = rest(q, plan, **options)
        o, part_lse = got if return_lse else (got, None)
        out[sel] = o
        if lse is not None:
            lse[sel] = part_lse
    return (out, lse) if lse is not None else out
