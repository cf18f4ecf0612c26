"""Benchmarks and measurements that print their results side by side with the formula they check."""
