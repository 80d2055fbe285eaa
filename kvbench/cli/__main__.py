"""``python -m kvbench.cli``: the ``kvbench`` command."""

from kvbench.cli.app import main

main()
