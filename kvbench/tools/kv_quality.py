"""Output agreement of reduced-precision KV with full precision: the checks live in
:mod:`kvbench.run.quality` (``kvbench run`` makes them); this name keeps working for code
that imports them from the tools."""

from kvbench.run.quality import (
    Agreement,
    Capture,
    QualityRun,
    agreement,
    run_captured,
    summarize_agreement,
    weights_used,
)

__all__ = ["Agreement", "Capture", "QualityRun", "agreement", "run_captured",
           "summarize_agreement", "weights_used"]
