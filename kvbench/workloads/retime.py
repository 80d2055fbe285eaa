"""Re-timing a workload's arrivals at run time, as ``vllm bench serve`` users expect.

``vllm bench serve --request-rate R --burstiness B`` sends its requests in order, the first
at once and each next one a gamma-distributed gap later: shape ``B``, scale ``1 / (R · B)``,
so the mean gap is ``1 / R`` whatever ``B`` (``B = 1`` is Poisson, ``B < 1`` burstier,
``B > 1`` steadier), and ``R = inf`` sends everything at once. ``retime`` gives any
workload (preset, spec, trace or file) exactly that schedule, drawn from ``seed``, and keeps
everything else: request order, ids, segments, output lengths, sessions and prefix groups.

Multi-turn sessions keep each session's turn order, because arrivals stay non-decreasing in
request order and a session's turns come in order. Their think times do not survive: the
gap between two turns of a session becomes the sum of the process's gaps over the requests
between them (at rate ``R``, ``(k + 1) / R`` on average with ``k`` requests in between),
and at ``R = inf`` all turns arrive at 0 s, like every other request. That is what the
benchmark client does with a multi-turn dataset; to keep think times, regenerate the workload
from its spec with another ``arrival`` process instead (it times session starts).
"""

from __future__ import annotations

import math

import numpy as np

from kvbench.errors import KvbenchError
from kvbench.workloads.arrivals import GammaArrivals
from kvbench.workloads.bulk import collector_paused, new_request
from kvbench.workloads.limits import MAX_ARRIVAL_S
from kvbench.workloads.model import Workload


def retime(
    workload: Workload, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> Workload:
    """``workload`` with arrivals at ``request_rate`` requests/s (``math.inf``: all at 0 s)
    and gamma ``burstiness``, deterministic from ``seed``; see the module docstring."""
    if not request_rate > 0:  # also refuses NaN
        raise KvbenchError(
            f"request rate must be > 0 requests/s, or inf for all at once (got {request_rate})"
        )
    if not 0 < burstiness < math.inf:
        raise KvbenchError(
            f"burstiness must be a finite number > 0 (got {burstiness}); 1 is Poisson, "
            "below 1 burstier, above 1 steadier"
        )
    n = len(workload.requests)
    if request_rate == math.inf:
        times = np.zeros(n)
    else:
        process = GammaArrivals(rate=request_rate, burstiness=burstiness)
        times = process.times(np.random.default_rng(seed), n)
    if n and times[-1] > MAX_ARRIVAL_S:
        raise KvbenchError(
            f"at {request_rate} requests/s the {n:,} requests would arrive over "
            f"{times[-1]:,.0f} s, more than the {MAX_ARRIVAL_S / 86_400:.0f} days a workload "
            "may span; raise the request rate"
        )
    with collector_paused():
        requests = [
            new_request(
                r.id, t, r.segments, r.output_tokens, r.prefix_group, r.session_id, r.n
            )
            for r, t in zip(workload.requests, times.tolist(), strict=True)
        ]
    rate = "inf" if request_rate == math.inf else request_rate  # JSON has no infinity
    return Workload(
        name=workload.name,
        requests=requests,
        seed=workload.seed,
        spec={
            "retimed": {"request_rate": rate, "burstiness": burstiness, "seed": seed},
            "of": workload.spec,
        },
        source=f"{workload.source}, re-timed at {rate} requests/s, burstiness {burstiness}",
        warnings=list(workload.warnings),
    )
