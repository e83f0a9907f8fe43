"""Rotary position embeddings, including Llama-3's `rope_scaling` (rope_type "llama3")."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ssd_jax.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Per-pair inverse frequencies [D/2], computed once on the host in float64."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv.astype(np.float32)
    # Llama 3.1: wavelengths longer than original_ctx/low_freq_factor are divided by `factor`,
    # shorter than original_ctx/high_freq_factor are kept, the band between is interpolated.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    interpolated = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = np.where(wavelen > low_wavelen, inv / scaling.factor,
                   np.where(wavelen < high_wavelen, inv, interpolated))
    return out.astype(np.float32)


def apply_rope(
    x: Float[Array, "B T H D"], positions: Int[Array, "B T"], inv_freq: Float[Array, " D2"]
) -> Float[Array, "B T H D"]:
    """HF's rotate-half convention: the two halves of each head are the rotated pairs."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
