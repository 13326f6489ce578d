"""Helpers the tests and the benchmarks share, by public name (tests/ is on the import path)."""
