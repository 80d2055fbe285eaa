"""kvbench: benchmark suite and regression-CI toolkit for KV-cache memory management."""

__version__ = "0.1.0"
