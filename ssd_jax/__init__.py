"""ssd-jax: speculative speculative decoding (SSD / Saguaro) in JAX."""
from ssd_jax.config import EngineConfig, ModelConfig, SamplingParams
from ssd_jax.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "EngineConfig", "ModelConfig", "SamplingParams"]
__version__ = "0.1.0"
