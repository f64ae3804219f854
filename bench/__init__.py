"""Micro-benchmarks, run as `python -m bench.<name>` from the repository root."""
