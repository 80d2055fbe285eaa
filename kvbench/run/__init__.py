"""Running: suite files and flags, the run plan, the harness and its clocks, telemetry probes."""
