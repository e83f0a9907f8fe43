"""Pallas kernels: tree attention (committed prefix + masked new tokens) for GPU and TPU."""
from pallas_kernels.tree_attention import select_attention, tree_attention

__all__ = ["select_attention", "tree_attention"]
