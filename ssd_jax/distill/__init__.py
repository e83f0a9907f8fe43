"""Distil a small draft model from the SmolLM2 target (data, training, measurement).

    python -m ssd_jax.distill data      # target responses + corpus, labelled with target top-k
    python -m ssd_jax.distill train     # KD training, resumable; exports checkpoints/smollm2-draft
    python -m ssd_jax.distill onpolicy  # a trained draft answers fresh prompts, the target labels
    python -m ssd_jax.distill measure   # acceptance and latency on held-out prompts

`make draft` runs the whole shipped pipeline: data, a bootstrap draft, on-policy data from it,
and the final training continued from the bootstrap (`train --init`).
"""
