"""Benchmarks and the aio tuning tool (`tensorio-bench`)."""
