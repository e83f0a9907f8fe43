"""Llama-3.x / Qwen3 decoders in Flax NNX and the attention primitive they share."""
from ssd_jax.models.attention import attend, causal_mask
from ssd_jax.models.transformer import KVCache, Transformer, commit

__all__ = ["attend", "causal_mask", "KVCache", "Transformer", "commit"]
