"""The ``kvbench`` command line: the app and its entry point are in :mod:`kvbench.cli.app`."""
