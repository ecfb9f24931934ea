"""Baseline services for ``bench.load_bench``: the same primary model served the usual ways."""
