"""Reporting, from saved records only: tables, figures, published pages, the regression gate
with its thresholds and stored baselines."""
