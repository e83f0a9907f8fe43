"""XLA:CPU settings that ssd-jax's entry points (CLI, server, bench, worker processes) apply
before JAX starts its CPU backend.

XLA:CPU writes its own code for matrix-vector products (every batch-1 decode step: AR, SD's
draft steps, a backup speculator) and targets 256-bit vectors by default. On a CPU with
AVX-512 the 512-bit form streams weights faster: one [1,1536] x [1536,8960] fp32 product on one
core took 1.31 -> 1.0 ms, a Qwen2.5-Coder-1.5B step 184 -> 154 ms, a 0.5B step 60 -> 55 ms.
Products over more rows (verification, SSD's tree steps) go to Eigen and do not change.

A flag the user already set wins: XLA_FLAGS=--xla_cpu_prefer_vector_width=256 turns this off.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

WIDE_VECTORS = "--xla_cpu_prefer_vector_width=512"


def read_cpuinfo() -> str:
    """/proc/cpuinfo, or "" where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def has_avx512(cpuinfo: str | None = None) -> bool:
    """Whether this (Linux) CPU advertises AVX-512F; False where that cannot be read."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
    return any(line.startswith("flags") and "avx512f" in line.split()
               for line in cpuinfo.splitlines())


def prefer_wide_vectors(environ: MutableMapping[str, str] = os.environ,
                        cpuinfo: str | None = None) -> bool:
    """Add WIDE_VECTORS to environ's XLA_FLAGS on an AVX-512 CPU unless a vector width is
    already chosen there. Takes effect only before JAX's CPU backend starts. Returns whether
    the flag was added."""
    flags = environ.get("XLA_FLAGS", "")
    if "xla_cpu_prefer_vector_width" in flags or not has_avx512(cpuinfo):
        return False
    environ["XLA_FLAGS"] = f"{flags} {WIDE_VECTORS}".strip()
    return True


def with_device_count(flags: str, devices: int | None) -> str:
    """XLA_FLAGS with any CPU device count replaced by `devices` (None or 1: XLA's one
    device); the caller's other flags are kept."""
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    if devices and devices > 1:
        kept.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(kept)
