"""Benchmarks: `python -m bench.<name>` from the repository root (see docs/results.md)."""
