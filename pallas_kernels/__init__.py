"""Pallas kernels: tree attention (committed prefix + masked new tokens) for GPU and TPU.

Which attention a model runs is decided in one place, `ssd_jax.models.attention.select_attention`."""
from pallas_kernels.tree_attention import tree_attention

__all__ = ["tree_attention"]
