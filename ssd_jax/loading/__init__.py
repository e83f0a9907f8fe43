"""Model loading: HF safetensors directories, GGUF files, ssd_jax orbax checkpoints."""
from ssd_jax.loading.registry import load, smollm2_gguf
from ssd_jax.loading.tokenizer import Tokenizer

__all__ = ["load", "smollm2_gguf", "Tokenizer"]
