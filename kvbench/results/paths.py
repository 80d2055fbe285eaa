"""Paths at kvbench's edges: names that become path components, and paths kept out of
published text."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from kvbench.errors import KvbenchError

_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")
# File systems take names of up to 255 bytes; kvbench adds to these names (".json", a
# "-sweep-<time>" suffix, an atomic write's ".NAME.XXXXXXXX.tmp"), so they stop well short.
MAX_NAME_CHARS = 128


def path_component_problem(name: str, what: str) -> str | None:
    """Why ``name`` cannot be one file or folder name under a kvbench folder, or None.
    ``what`` names it in the message ("suite", "engine").

    Only letters, digits, ``.``, ``_`` and ``-``: no separators, so no way out of the
    folder (``../x``) or into an absolute path. No leading ``.``: besides ``.`` and ``..``,
    record folders skip hidden names, so such a file would be written but never read. At
    most ``MAX_NAME_CHARS`` characters.
    """
    if not isinstance(name, str) or not _COMPONENT.fullmatch(name) or name.startswith("."):
        return (
            f"{what} {name!r} cannot be a file or folder name: use only letters, digits, "
            "'.', '_' and '-', not starting with '.'"
        )
    return name_length_problem(name, what)


def name_length_problem(name: str, what: str) -> str | None:
    """Why ``name`` is too long to name files and folders, or None."""
    if len(name) <= MAX_NAME_CHARS:
        return None
    return (
        f"{what} name {short_name(name)!r} has {len(name):,} characters; names of files and "
        f"folders take at most {MAX_NAME_CHARS}: give a shorter one"
    )


def short_name(name: str, keep: int = 40) -> str:
    """``name`` cut for a message: its first ``keep`` characters and an ellipsis."""
    return name if len(name) <= keep else name[:keep] + "…"


# Linux's NAME_MAX and PATH_MAX, in bytes: the file system refuses longer names outright.
_NAME_MAX_BYTES = 255
_PATH_MAX_BYTES = 4095


def path_length_problem(path: str, what: str) -> str | None:
    """Why the file system would refuse the path ``path`` (``what`` it names) as too long,
    or None: asked about such a path, Python raises where a missing file is expected."""
    size = len(os.fsencode(path))
    longest = max(len(os.fsencode(part)) for part in path.split("/"))
    if size > _PATH_MAX_BYTES or longest > _NAME_MAX_BYTES:
        return (
            f"{what} {short_name(path)!r} ({size:,} bytes) is too long a path: a file or "
            f"folder name may take {_NAME_MAX_BYTES} bytes, a path {_PATH_MAX_BYTES}"
        )
    return None


def check_path_component(name: str, what: str) -> str:
    """``name`` if it can be one file or folder name under a kvbench folder (see
    :func:`path_component_problem`), else a KvbenchError saying why."""
    problem = path_component_problem(name, what)
    if problem is not None:
        raise KvbenchError(problem)
    return name


def redact_home(text: str, home: str | None = None) -> str:
    """``text`` (a command line, a path) with the user's home folder written as ``~``."""
    home = (home if home is not None else os.path.expanduser("~")).rstrip("/")
    if not home or home == "~":
        return text
    return re.sub(re.escape(home) + r"(?=/|$|[\s'\"])", "~", text)


# An absolute path: a "/" that starts a token (at the start, after whitespace, a quote, "=",
# ":" or "," as in --out=/x or mooncake:/x) followed by a name, or a Windows drive path.
# "1/2", "used/reserved" and an already cut "…/name" are no absolute paths.
_ABSOLUTE_PATH = re.compile(
    r"(?<![^\s'\"`=:,(\[])/[^\s'\"`,;|()<>]*[^\s'\"`,;|()<>/.:]"
    r"|(?<![\w])[A-Za-z]:\\[^\s'\"`,;|()<>]*[^\s'\"`,;|()<>\\.:]"
)


def _last_name(path: str) -> str:
    return re.split(r"[/\\]", path)[-1]


def redact_paths(text: str, hostnames: Iterable[str] = ()) -> str:
    """``text`` for publication: absolute paths cut to ``…/<last name>``, and each hostname
    (of three or more characters, where it stands as a name of its own) written ``{host}``."""
    text = _ABSOLUTE_PATH.sub(lambda m: "…/" + _last_name(m.group(0)), text)
    names = {n for host in hostnames if host for n in (host, host.split(".")[0]) if len(n) > 2}
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", "{host}", text)
    return text
