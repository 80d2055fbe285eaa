"""Results: the run-record schema, the in-memory log of a run (``runlog``), and the metrics,
curves, leak analysis and repeat folding that build records from it."""
