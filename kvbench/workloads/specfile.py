"""Generator spec files: a whole ``WorkloadSpec`` table in TOML or JSON.

A TOML spec file looks like::

    num_requests = 200
    arrival = { kind = "gamma", rate = 4.0, burstiness = 0.5 }

    [[classes]]
    name = "chat"
    prompt = { kind = "lognormal", median = 200, sigma = 0.9, max = 1024 }
    output = { kind = "uniform", low = 16, high = 256 }
    images = { count = { kind = "fixed", value = 1 }, sizes = [[448, 448]], rule = "qwen2-vl" }
    session = { turns = { kind = "uniform", low = 2, high = 4 }, think_time_s = 5.0 }

and the same keys as a JSON object. Errors name the file and, for a bad value, its key path.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError
from kvbench.fileio import read_text
from kvbench.workloads.spec import WorkloadSpec, parse_spec
from kvbench.workloads.textstream import too_deep

_TOML_AT = re.compile(r"\(at line (\d+), column \d+\)")


def load_spec_file(path: str | Path) -> WorkloadSpec:
    """The generator spec held by a ``.toml`` or ``.json`` file."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise InputFileError(p, "a workload spec file must end in .toml or .json")
    text = read_text(p, "workload spec")
    try:
        data = _parse(text, p, suffix)
    except RecursionError:
        raise too_deep(p, "workload spec") from None
    return parse_spec(data, str(p))


def _parse(text: str, p: Path, suffix: str) -> Any:
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            at = _TOML_AT.search(str(e))
            message = _TOML_AT.sub("", str(e)).strip()
            raise InputFileError(
                p, f"not valid TOML: {message}", int(at[1]) if at else None
            ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(p, f"not valid JSON: {e.msg}", e.lineno) from None
