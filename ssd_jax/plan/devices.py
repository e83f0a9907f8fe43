"""Accelerators the planner knows: memory capacity, HBM bandwidth, dense bf16 peak, link bandwidth.

Capacity, bandwidth and peak are vendor datasheet figures (decimal units: 1 GB = 1e9 bytes).
`link_bw` is the per-direction chip-to-chip bandwidth (NVLink / ICI). `collective_s` is *our
assumption*, not a vendor figure: the latency of one small all-reduce at batch-1 decode sizes,
where collectives are latency-bound (NCCL over NVLink and XLA over ICI are both ~5-10 us).
"""
from __future__ import annotations

from dataclasses import dataclass

GB, TB, TFLOP = 1e9, 1e12, 1e12


@dataclass(frozen=True, kw_only=True)
class Device:
    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    peak_flops: float  # bf16 dense FLOP/s
    link_bw: float  # bytes/s per direction
    collective_s: float  # assumed small-message collective latency


DEVICES = {
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense (1,979 with
    # sparsity), NVLink 4 at 900 GB/s bidirectional.
    "h100-80gb": Device(name="H100-80GB", hbm_bytes=80 * GB, hbm_bw=3.35 * TB,
                        peak_flops=989 * TFLOP, link_bw=450 * GB, collective_s=8e-6),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, same compute and NVLink as H100 SXM.
    "h200": Device(name="H200", hbm_bytes=141 * GB, hbm_bw=4.8 * TB, peak_flops=989 * TFLOP,
                   link_bw=450 * GB, collective_s=8e-6),
    # NVIDIA A100 SXM4 80GB datasheet: 2,039 GB/s HBM2e, 312 TFLOP/s bf16 dense, NVLink 3 at
    # 600 GB/s bidirectional.
    "a100-80gb": Device(name="A100-80GB", hbm_bytes=80 * GB, hbm_bw=2.039 * TB,
                        peak_flops=312 * TFLOP, link_bw=300 * GB, collective_s=8e-6),
    # Google Cloud TPU v5e docs: 16 GB HBM2, 819 GB/s, 197 TFLOP/s bf16, ICI 1,600 Gbps/chip.
    "tpu-v5e": Device(name="TPU v5e", hbm_bytes=16 * GB, hbm_bw=819 * GB,
                      peak_flops=197 * TFLOP, link_bw=200 * GB, collective_s=5e-6),
    # Google Cloud TPU v5p docs: 95 GB HBM2e, 2,765 GB/s, 459 TFLOP/s bf16, ICI 4,800 Gbps/chip.
    "tpu-v5p": Device(name="TPU v5p", hbm_bytes=95 * GB, hbm_bw=2.765 * TB,
                      peak_flops=459 * TFLOP, link_bw=600 * GB, collective_s=5e-6),
}
_ALIASES = {"h100": "h100-80gb", "h200-141gb": "h200", "a100": "a100-80gb", "v5e": "tpu-v5e",
            "v5p": "tpu-v5p", "tpuv5e": "tpu-v5e", "tpuv5p": "tpu-v5p"}


def get_device(name: str) -> Device:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}: use one of {', '.join(DEVICES)}")
    return DEVICES[key]
