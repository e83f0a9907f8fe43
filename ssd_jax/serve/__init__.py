"""An OpenAI-compatible server over the engine: `python -m ssd_jax.serve` (or `ssd-serve`)."""
