"""Measurement helpers: the counters, saved-bytes hooks, formulas and fake process groups that the benches print
and the tests assert on. A bench (bench/) imports from here and prints; a test imports from here and checks."""
