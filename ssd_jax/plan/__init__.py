"""Planning large layouts without weights: published configs, per-device memory from
`jax.eval_shape` trees, refusal of layouts that do not fit, and a roofline + Theorem-7 speed model.
`ssd-bench plan` (bench/plan.py) is the command-line face of this package."""
from ssd_jax.plan.devices import DEVICES, Device, get_device
from ssd_jax.plan.hf_configs import HF_CONFIGS, resolve
from ssd_jax.plan.layout import LayoutError, MeshMemory, Setup, check_fits
from ssd_jax.plan.roofline import Assumptions, Prediction, expected_tokens, predict

__all__ = ["DEVICES", "Device", "get_device", "HF_CONFIGS", "resolve", "LayoutError",
           "MeshMemory", "Setup", "check_fits", "Assumptions", "Prediction", "expected_tokens",
           "predict"]
