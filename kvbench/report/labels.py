"""The one rule that names records on pages, tables and figures: an engine's name, qualified
where several records share it by what tells them apart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvbench.report.baselines import machine_slug
from kvbench.results.schema import RunRecord
from kvbench.units import format_bytes


def _short_commit(commit: str | None) -> str:
    if commit is None:
        return "no git"
    return commit[:8] + ("-dirty" if commit.endswith("-dirty") else "")


def _facts(r: RunRecord, folder: str | None) -> tuple[str, ...]:
    # In the order a reader asks: which suite, device, machine, KV budget, run, code, time.
    return (r.suite, r.device, machine_slug(r.machine),
            f"KV {format_bytes(r.summary.get('kv_capacity_bytes'))}", folder or "",
            _short_commit(r.git_commit), r.created_utc)


def engine_labels(records: Sequence[RunRecord],
                  folders: Sequence[Path] | None = None) -> list[str]:
    """Engine names; where several records share one, each is qualified by the first fact
    (suite, device, machine, KV budget, run folder, commit, start time) that differs between
    all of them, else by all facts that vary, else by its position. ``folders`` are the
    records' run folders, where known."""
    names = [r.engine for r in records]
    folder_names = [p.name for p in folders] if folders is not None else [None] * len(names)
    facts = [_facts(r, f) for r, f in zip(records, folder_names, strict=True)]
    out = []
    for k, (name, mine) in enumerate(zip(names, facts, strict=True)):
        group = [g for n, g in zip(names, facts, strict=True) if n == name]
        if len(group) == 1:
            out.append(name)
            continue
        telling = next((i for i in range(len(mine))
                        if len({g[i] for g in group}) == len(group)), None)
        varying = [i for i in range(len(mine)) if len({g[i] for g in group}) > 1]
        if telling is not None:
            out.append(f"{name} ({mine[telling]})")
        elif varying and len({tuple(g[i] for i in varying) for g in group}) == len(group):
            out.append(f"{name} ({', '.join(mine[i] for i in varying)})")
        else:
            out.append(f"{name} (#{k + 1})")
    return out
