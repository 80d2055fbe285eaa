"""Summary statistics of a workload (what ``kvbench workload show`` prints)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.workloads.model import SEGMENT_KINDS, Request, Workload

# vLLM's default KV block size: prefix caching can only reuse whole blocks.
DEFAULT_BLOCK_TOKENS = 16


def _percentiles(values: list[int]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
        "max": float(a.max()),
    }


class _PrefixIndex:
    """Earlier prompts as a trie over runs of content.

    A segment is a run of its key's ids from offset 0, so two prompts agree up to the first
    run where (key, tokens) differ; there they still agree over the shorter of the two runs
    when the keys are equal. The index stores, per trie node, the children by (key, tokens)
    and the longest run seen per key, which is all that rule needs; no ids are materialised.
    """

    def __init__(self) -> None:
        self._child: dict[tuple[int, str, int], int] = {}
        self._longest: dict[tuple[int, str], int] = {}

    def longest_common_prefix(self, request: Request) -> int:
        """Longest prefix (tokens) ``request`` shares with any earlier one; then adds it."""
        node, matched, shared, diverged = 0, 0, 0, False
        for s in request.segments:
            if not diverged:
                child = self._child.get((node, s.key, s.tokens))
                if child is not None:
                    node, matched = child, matched + s.tokens
                    shared = matched
                    continue
                shared = matched + min(s.tokens, self._longest.get((node, s.key), 0))
                diverged = True
            # Insert the rest of this request below the point where it left the trie.
            longest = self._longest.get((node, s.key), 0)
            self._longest[(node, s.key)] = max(longest, s.tokens)
            new = len(self._child) + 1
            self._child[(node, s.key, s.tokens)] = new
            node = new
        return shared


def shareable_prefix_fraction(
    workload: Workload, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> float:
    """Fraction of prompt tokens in full blocks whose whole prefix, through that block, equals
    an earlier request's (what chained-hash prefix caching could reuse with unbounded cache)."""
    index = _PrefixIndex()
    shareable = total = 0
    for r in workload.requests:
        lcp = index.longest_common_prefix(r)
        shareable += lcp // block_tokens * block_tokens
        total += r.prompt_tokens
    return shareable / total if total else 0.0


def describe(workload: Workload, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> dict[str, Any]:
    """Counts, length percentiles, modality mix, shareable prefix, duration and rate."""
    reqs = workload.requests
    prompts = [r.prompt_tokens for r in reqs]
    outputs = [r.output_tokens for r in reqs]
    arrivals = [r.arrival_s for r in reqs]
    duration = max(arrivals) - min(arrivals) if reqs else 0.0
    modalities = {
        kind: {
            "requests": sum(1 for r in reqs if any(s.kind == kind for s in r.segments)),
            "tokens": sum(r.tokens_of(kind) for r in reqs),
        }
        for kind in SEGMENT_KINDS
    }
    return {
        "name": workload.name,
        "source": workload.source,
        "seed": workload.seed,
        "digest": workload.digest,
        "num_requests": len(reqs),
        "num_sequences": sum(r.n for r in reqs),
        "num_sessions": len({r.session_id for r in reqs if r.session_id is not None}),
        "num_prefix_groups": len({r.prefix_group for r in reqs if r.prefix_group is not None}),
        "prompt_tokens_total": sum(prompts),
        "output_tokens_total": sum(o * r.n for o, r in zip(outputs, reqs, strict=True)),
        "prompt_tokens": _percentiles(prompts) if reqs else None,
        "output_tokens": _percentiles(outputs) if reqs else None,
        "modalities": modalities,
        "shareable_prefix_fraction": shareable_prefix_fraction(workload, block_tokens),
        "block_tokens": block_tokens,
        "duration_s": duration,
        # n arrivals span n - 1 gaps; an offline workload (all at 0) has no rate.
        "mean_arrival_rate_per_s": (len(reqs) - 1) / duration if duration > 0 else None,
    }
