"""Benchmarks: `python -m bench.X`, each printing ratios against a baseline run in-process."""
