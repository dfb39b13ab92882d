"""Benchmarks: `python -m benchmarks.NAME`; each prints a markdown table and writes it as JSON."""
