"""The built-in engine: its scheduler, sequences' steps, and executors (real compute or the
cost model)."""
