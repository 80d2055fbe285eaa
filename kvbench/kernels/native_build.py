"""C sources built on first use and loaded with ctypes: the native attention kernel, the
replay's block pool, the offload tiers' key queues and the prefix-cache oracle.

A source is compiled with the machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``) for this CPU, within :data:`BUILD_TIMEOUT_S`, and cached under
``$KVBENCH_CACHE_DIR`` (default ``$XDG_CACHE_HOME/kvbench``, else ``~/.cache/kvbench``) by a
hash of its source, flags, compiler and CPU. Code loaded into this process must not be
writable by anyone else: the cache folder is made 0700, it and every folder above it are
checked (owner, mode), and a cached build is loaded only when its SHA-256 matches the one
recorded when it was built. A cache that fails a check, or cannot be written, is left alone
and the build goes to a private temporary folder instead (said once).

This module needs neither torch nor numpy: parsing a suite or running the replay's C helpers
does not load them through it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import signal
import stat
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any, Literal

from kvbench.fileio import write_text_atomic
from kvbench.kernels.notices import warn_once

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
