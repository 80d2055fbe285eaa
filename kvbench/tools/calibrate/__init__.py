"""Calibration of the cost model: measure a device, fit coefficients, keep a profile."""
