"""Benchmarks: each writes JSON (and a PNG plot) under ``bench_results/``."""
