"""The field reports' page-pool prewarm hint (P4): pages to reserve for a request at arrival.

The reports weight a request's tokens by modality, 0.4 text, 0.45 image, 0.15 audio, and
reserve ``ceil(weighted_tokens / 512)`` pages of 512 tokens. A policy with ``prewarm =
"hint"`` reserves that many tokens' worth of its own pages when the request arrives, and
the sequence starts from them when admitted.
"""

from __future__ import annotations

import math
from typing import Literal

from kvbench.workloads.model import Request

Prewarm = Literal["none", "hint"]
HINT_WEIGHTS = {"text": 0.4, "image": 0.45, "audio": 0.15}
HINT_PAGE_TOKENS = 512


def hint_tokens(request: Request) -> int:
    """Tokens of the reports' hint for ``request``: whole 512-token pages of its
    modality-weighted prompt."""
    weighted = sum(HINT_WEIGHTS[s.kind] * s.tokens for s in request.segments)
    return math.ceil(weighted / HINT_PAGE_TOKENS) * HINT_PAGE_TOKENS
