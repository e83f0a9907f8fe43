"""Distil a small draft model from the SmolLM2 target (data, training, measurement).

    python -m ssd_jax.distill data      # target responses + corpus, labelled with target top-k
    python -m ssd_jax.distill train     # KD training, resumable; exports checkpoints/smollm2-draft
    python -m ssd_jax.distill measure   # acceptance and latency on held-out prompts
"""
