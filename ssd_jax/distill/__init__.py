"""Distil a small draft model from the SmolLM2 target (data, training, measurement).

    python -m ssd_jax.distill data      # target responses + corpus, labelled with target top-k
    python -m ssd_jax.distill train     # KD training, resumable; exports to --out (default
                                        # ~/.cache/ssd_jax/distill-draft; `make draft` ships it)
    python -m ssd_jax.distill onpolicy  # a trained draft answers fresh prompts, the target labels
    python -m ssd_jax.distill measure   # acceptance and latency on held-out prompts

`make draft` runs the shipped pipeline (data, then 15 minutes of training). `onpolicy` plus
`train --init CKPT` continue a trained draft on its own answers; checkpoints/smollm2-draft/README.md
says what that gained and why it is not part of the shipped pipeline.
"""
