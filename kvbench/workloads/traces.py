"""Importers for public request traces, by kind.

- ``azure``: Azure LLM inference trace CSV (``azure_trace``);
- ``azure-lmm``: Azure LMM (multimodal) inference trace CSV, images sized by an image rule
  choice such as ``qwen2-vl:448x448`` (``azure_lmm_trace``);
- ``mooncake``: Mooncake JSONL with 512-token ``hash_ids`` blocks (``mooncake_trace``);
- ``sharegpt``: ShareGPT JSON conversations (``sharegpt_trace``).

Every importer reads UTF-8 (a byte-order mark is dropped) and refuses, naming the file and
line, a row whose values exceed ``limits`` or whose timestamp lies years from the others
(``trace_rows``). Content keys include the seed, as for generated workloads, so another seed
gives other ids.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvbench.errors import InputFileError, KvbenchError
from kvbench.workloads.azure_lmm_trace import DEFAULT_IMAGE_RULE, read_azure_lmm
from kvbench.workloads.azure_trace import read_azure
from kvbench.workloads.modalities import parse_image_choice
from kvbench.workloads.model import Workload
from kvbench.workloads.mooncake_trace import read_mooncake
from kvbench.workloads.sharegpt_trace import read_sharegpt
from kvbench.workloads.trace_rows import TraceRead

_READERS: dict[str, Callable[[Path, int | None, int], TraceRead]] = {
    "azure": read_azure,
    "mooncake": read_mooncake,
    "sharegpt": read_sharegpt,
}
# Traces whose rows count images without sizing them: their readers take an image choice.
_IMAGE_READERS: dict[str, Callable[..., TraceRead]] = {"azure-lmm": read_azure_lmm}
IMAGE_TRACE_KINDS: tuple[str, ...] = tuple(_IMAGE_READERS)
TRACE_KINDS: tuple[str, ...] = ("azure", "azure-lmm", "mooncake", "sharegpt")


def import_trace(
    kind: str,
    path: str | Path,
    limit: int | None = None,
    seed: int = 0,
    image_rule: str | None = None,
) -> Workload:
    """Read a trace file of the given ``kind`` (see ``TRACE_KINDS``).

    ``limit`` keeps the first that many requests of the file; when the file holds fewer,
    all are kept and ``Workload.warnings`` says so. ``image_rule`` (``RULE[:HxW]``, for the
    ``IMAGE_TRACE_KINDS`` only) sizes every image; ``azure-lmm`` defaults to ``llava-1.5``.
    Requests keep file order (stably sorted by arrival) and are numbered ``r0, r1, …`` in
    file order.
    """
    if kind not in TRACE_KINDS:
        raise KvbenchError(f"unknown trace kind {kind!r}; valid: {', '.join(TRACE_KINDS)}")
    if limit is not None and limit < 1:
        raise KvbenchError(f"limit must be >= 1 (got {limit})")
    if kind in _IMAGE_READERS:
        image = parse_image_choice(image_rule or DEFAULT_IMAGE_RULE)
        reader = partial(_IMAGE_READERS[kind], image=image)
    elif image_rule is not None:
        raise KvbenchError(
            f"an image rule applies only to traces that count images "
            f"({', '.join(IMAGE_TRACE_KINDS)}), not to {kind}"
        )
    else:
        reader = _READERS[kind]
    p = Path(path)
    read = reader(p, limit, seed)
    found, facts = read.requests, read.facts
    if not found:
        raise InputFileError(p, f"no requests found in this {kind} trace")
    warnings = list(read.warnings)
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
