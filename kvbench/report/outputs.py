"""A command's output files: every destination checked before anything is written, each file
written atomically, and a failure reported as what to fix instead of a traceback."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic


def _check_parent(path: Path) -> None:
    # The nearest existing ancestor must be a folder, so that the missing ones can be made.
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise KvbenchError(f"cannot write {path}: {parent} is a file, not a folder")
            return


def check_output_file(path: Path, what: str) -> None:
    """``path`` can be written as a file (``what`` names the option in the message)."""
    if path.is_dir():
        raise KvbenchError(f"{what} {path} is a folder; name a file")
    _check_parent(path)


def check_output_dir(path: Path, what: str) -> None:
    """``path`` is a folder or can be made one."""
    if path.exists() and not path.is_dir():
        raise KvbenchError(f"{what} {path} is a file; name a folder")
    _check_parent(path)


def write_outputs(files: Sequence[tuple[Path, str, str]]) -> list[Path]:
    """Write (path, text, what) files, all checked first; ``what`` names each in messages."""
    seen: dict[Path, str] = {}
    for path, _, what in files:
        check_output_file(path, what)
        key = path.resolve()
        if key in seen:
            raise KvbenchError(f"{seen[key]} and {what} both name {path}; give each its own file")
        seen[key] = what
    written = []
    for path, text, _ in files:
        try:
            written.append(write_text_atomic(path, text))
        except OSError as exc:
            raise KvbenchError(f"cannot write {path}: {exc.strerror or exc}") from None
    return written
