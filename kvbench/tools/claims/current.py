"""Whether the published verdicts still hold: the studies of a published ``seed-claims.json``
run again at its size, and every verdict and figure compared with what the code now
computes. Rows whose figures are the machine's own (wall-clock timings) are left out: they
are redone by a full ``kvbench claims`` on a quiet machine, not compared."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError
from kvbench.tools.claims.core import Context, order_key, run_one

# Rows with wall-clock figures: C5 (host allocator timings), P11 (peak RSS spread).
MACHINE_ROWS = frozenset({"C5", "P11"})


def _published(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    try:
        data = json.loads(path.read_text())
        rows = {r["id"]: r for r in data["rows"]}
        meta = data["meta"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputFileError(path, f"not a seed-claims.json that `kvbench claims` wrote "
                                   f"({exc}); give the JSON beside the published table") from None
    return meta, rows


def differences(old: Any, new: Any, where: str) -> list[str]:
    """Where ``new`` differs from ``old`` (JSON values; floats to 9 significant digits)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{where}.{k}: only in {'the published row' if k in old else 'the new row'}"
               for k in sorted(old.keys() ^ new.keys())]
        for k in sorted(old.keys() & new.keys()):
            out += differences(old[k], new[k], f"{where}.{k}")
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True))
                for d in differences(a, b, f"{where}[{i}]")]
    if (isinstance(old, float | int) and isinstance(new, float | int)
            and not isinstance(old, bool) and not isinstance(new, bool)):
        same = math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-12)
        return [] if same else [f"{where}: published {old!r}, now {new!r}"]
    return [] if old == new else [f"{where}: published {old!r}, now {new!r}"]


def check_current(published: Path, out_dir: Path, *, max_seconds: float | None = None,
                  only: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(the ids checked, the differences found). ``max_seconds`` keeps only rows whose
    published study took at most that long (the quick form CI runs)."""
    meta, rows = _published(published)
    ids = [i for i in sorted(rows, key=order_key) if i not in MACHINE_ROWS
           and (only is None or i in only)
           and (max_seconds is None or rows[i].get("seconds", math.inf) <= max_seconds)]
    ctx = Context(out_dir, meta.get("mode") == "quick")
    found: list[str] = []
    for ident in ids:
        # Through JSON as the published file went: tuples as lists, keys as strings.
        new = json.loads(json.dumps(asdict(run_one(ctx, ident)), default=str))
        old = rows[ident]
        found += [f"{ident}: {d}" for key in ("verdict", "measured", "data")
                  for d in differences(old.get(key), new.get(key), key)]
    return ids, found
