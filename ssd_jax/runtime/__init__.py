"""The runtime around the decode core: worker processes (one per side, pinned to their cores,
joined by `jax.distributed`), the pool that starts, feeds and stops them, and multi-host
start-up. The core's rounds run here unchanged; only the transport differs."""
