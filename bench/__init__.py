"""Benchmarks: each ``bench_*.py`` prints a table; ``python -m bench.run`` runs them all."""
