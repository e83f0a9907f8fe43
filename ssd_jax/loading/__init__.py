"""Model loading: HF safetensors directories, GGUF files, ssd_jax orbax checkpoints."""
from ssd_jax.loading.registry import (check_same_vocabulary, describe, load, pair_vocab,
                                      smollm2_gguf, vocab_from_extra)
from ssd_jax.loading.tokenizer import Tokenizer

__all__ = ["check_same_vocabulary", "describe", "load", "pair_vocab", "smollm2_gguf", "Tokenizer",
           "vocab_from_extra"]
