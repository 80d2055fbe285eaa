"""asv benchmark suite (asv requires its benchmark folder to be a package). The folder also
holds the named suite files (``suites/``) and pytest-benchmark micro-benchmarks
(``test_bench_*.py``); asv imports those modules too and finds no benchmarks in them."""
