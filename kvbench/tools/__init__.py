"""Tools built on runs: calibration, capacity planning, soak and sweep."""
