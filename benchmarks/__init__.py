"""Benchmarks that produce the numbers and figures in the README (run as modules)."""
