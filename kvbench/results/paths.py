"""Paths at kvbench's edges: names that become path components, and paths kept out of
published text."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from kvbench.errors import KvbenchError

_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")


def check_path_component(name: str, what: str) -> str:
    """``name`` if it can be one file or folder name under a kvbench folder, else a
    KvbenchError saying why. ``what`` names it in the message ("suite", "engine").

    Only letters, digits, ``.``, ``_`` and ``-``: no separators, so no way out of the
    folder (``../x``) or into an absolute path. No leading ``.``: besides ``.`` and ``..``,
    record folders skip hidden names, so such a file would be written but never read.
    """
    if not isinstance(name, str) or not _COMPONENT.fullmatch(name) or name.startswith("."):
        raise KvbenchError(
            f"{what} {name!r} cannot be a file or folder name: use only letters, digits, "
            "'.', '_' and '-', not starting with '.'"
        )
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
