"""Upper bounds on workload values, in one place.

Every importer, the workload file reader and the generator refuse values past these, naming
the file and line (or the spec and request), because such a value is a typo or a corrupt row,
never a workload anyone meant: better refused now than a MemoryError or a replay that waits
for years later.

- ``MAX_SEQUENCE_TOKENS`` = 2^31 − 1: a request's prompt plus its output is one sequence,
  whose length must fit the int32 context lengths the attention kernels take.
- ``MAX_SAMPLES`` = 1024 parallel samples per request (``n``): eight times the OpenAI API's
  limit of 128, and beyond any best-of-n study; each sample is a sequence with its own KV.
- ``MAX_ARRIVAL_S`` = 366 days: the latest arrival, so also the longest span a trace may
  cover. The traces kvbench reads cover an hour (Azure 2023, Mooncake) to a week (Azure
  2024, Azure LMM 2025); a longer span means a bad timestamp (one row from 1900 among rows
  from 2023 would make a replay wait 123 years).

Generating is bounded by memory instead: ``estimate_bytes`` predicts the Python heap a
generated workload takes, and the generator refuses when that exceeds ``memory_limit_bytes``
(this machine's physical memory), before it allocates anything.
"""

from __future__ import annotations

import os

from kvbench.errors import KvbenchError
from kvbench.units import format_bytes

MAX_SEQUENCE_TOKENS = 2**31 - 1
MAX_SAMPLES = 1024
MAX_ARRIVAL_S = 366 * 86_400.0

# Heap bytes on 64-bit CPython 3.11, fitted to tracemalloc peaks of the presets (within 10%):
# a Request (88) with its id string, arrival float, output int, list slot and tuple header;
# a new Segment (88) with its key string and token int; a tuple slot per prompt segment.
REQUEST_BYTES = 230
SEGMENT_BYTES = 175
SEGMENT_REF_BYTES = 8
# numpy draws and lists alive while the generator builds the requests.
GENERATION_SCRATCH_BYTES = 90


def request_problem(prompt_tokens: int, output_tokens: int, n: int = 1) -> str | None:
    """What makes these request values absurd, or None when they are within the limits."""
    if prompt_tokens + output_tokens > MAX_SEQUENCE_TOKENS:
        return (
            f"prompt ({prompt_tokens:,}) plus output ({output_tokens:,}) tokens exceed "
            f"{MAX_SEQUENCE_TOKENS:,}, the longest sequence int32 positions can index"
        )
    if n > MAX_SAMPLES:
        return f"n = {n:,} parallel samples is more than the limit of {MAX_SAMPLES:,}"
    return None


def arrival_problem(arrival_s: float) -> str | None:
    """What is wrong with an arrival time (seconds from the start), or None."""
    if not 0 <= arrival_s <= MAX_ARRIVAL_S:  # also false for NaN
        return (
            f"arrival_s {arrival_s!r} is not within 0 to {MAX_ARRIVAL_S:.0f} s (366 days), "
            "the longest a workload may span"
        )
    return None


def estimate_bytes(requests: int, segments: int, segment_refs: int) -> int:
    """Heap bytes of ``requests`` requests holding ``segments`` distinct new Segments,
    ``segment_refs`` segment slots in all their prompts, plus the generator's scratch."""
    return (
        requests * (REQUEST_BYTES + GENERATION_SCRATCH_BYTES)
        + segments * SEGMENT_BYTES
        + segment_refs * SEGMENT_REF_BYTES
    )


def memory_limit_bytes() -> int | None:
    """This machine's physical memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_generation_memory(requests: int, segments: int, segment_refs: int, what: str) -> None:
    """Refuse to build a workload whose estimated heap exceeds the machine's memory."""
    need = estimate_bytes(requests, segments, segment_refs)
    limit = memory_limit_bytes()
    if limit is not None and need > limit:
        per = need / requests
        fit = int(limit / per)
        raise KvbenchError(
            f"{what}: {requests:,} requests would need about {format_bytes(need)} of memory "
            f"({per:.0f} B each), more than this machine's {format_bytes(limit)}; "
            f"ask for at most about {fit:,} requests"
        )
