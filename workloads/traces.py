"""Importers for public request traces, by kind.

- ``azure``: Azure LLM inference trace CSV (``azure_trace``);
- ``mooncake``: Mooncake JSONL with 512-token ``hash_ids`` blocks (``mooncake_trace``);
- ``sharegpt``: ShareGPT JSON conversations (``sharegpt_trace``).

Every importer reads UTF-8 (a byte-order mark is dropped) and refuses, naming the file and
line, a row whose values pass ``limits`` or whose timestamp lies years from the others
(``trace_rows``). Content keys include the seed, as for generated workloads, so another seed
gives other ids.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench.errors import InputFileError, KvbenchError

from .azure_trace import read_azure
from .model import Request, Workload
from .mooncake_trace import read_mooncake
from .sharegpt_trace import read_sharegpt

_Reader = Callable[[Path, int | None, int], tuple[list[Request], dict[str, Any]]]
_READERS: dict[str, _Reader] = {
    "azure": read_azure,
    "mooncake": read_mooncake,
    "sharegpt": read_sharegpt,
}
TRACE_KINDS: tuple[str, ...] = tuple(_READERS)


def import_trace(kind: str, path: str | Path, limit: int | None = None, seed: int = 0) -> Workload:
    """Read a trace file of the given ``kind`` (see ``TRACE_KINDS``).

    ``limit`` keeps the first that many requests of the file; when the file holds fewer,
    all are kept and ``Workload.warnings`` says so. Requests keep file order (stably sorted
    by arrival) and are numbered ``r0, r1, …`` in file order.
    """
    if kind not in _READERS:
        raise KvbenchError(f"unknown trace kind {kind!r}; valid: {', '.join(TRACE_KINDS)}")
    if limit is not None and limit < 1:
        raise KvbenchError(f"limit must be >= 1 (got {limit})")
    p = Path(path)
    found, facts = _READERS[kind](p, limit, seed)
    if not found:
        raise InputFileError(p, f"no requests found in this {kind} trace")
    warnings = []
    if limit is not None and len(found) < limit:
        warnings.append(
            f"asked for {limit:,} requests but {p} holds {len(found):,}; using all of them"
        )
    spec = {"trace": kind, "file": p.name, "limit": limit, **facts}
    requests = sorted(found, key=lambda r: r.arrival_s)
    return Workload(
        name=p.stem, requests=requests, seed=seed, spec=spec, source=str(path),
        warnings=warnings,
    )
