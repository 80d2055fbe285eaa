"""Results: the run-record schema, and the metrics, curves, leak analysis and repeat folding
that build records from a run."""
