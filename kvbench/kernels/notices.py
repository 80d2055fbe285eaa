"""What a user must know about the kernels chosen (``auto`` falling back to the reference, a
build cache that cannot be used), said once per process by :func:`warn_once`: on stderr, or
into the list a caller collects them in (:func:`kvbench.kernels.backend.collected_warnings`).

Below the backends, so that a backend's own module can warn without importing the registry
of backends.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar
from functools import cache

# The list a caller collects the kernels' warnings into; None: they go to stderr.
COLLECTOR: ContextVar[list[str] | None] = ContextVar("kernel_warnings", default=None)


@cache
def warn_once(message: str) -> None:
    """Say ``message`` once per process: to the collecting caller, else on stderr."""
    said = COLLECTOR.get()
    if said is not None:
        said.append(message)
    else:
        print(f"warning: {message}", file=sys.stderr)
