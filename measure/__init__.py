"""Measurements: one module per measurement, each with its CLI (``python -m measure.NAME``), and the counters,
saved-bytes hooks and formulas that the tests assert on. No library room imports this one."""
