"""The ``kvbench`` command line."""

from kvbench.cli.app import main

__all__ = ["main"]
