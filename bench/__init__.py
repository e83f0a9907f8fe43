"""Benchmarks: the ssd-bench CLI and focused scripts (AR vs torch, kernels)."""
