"""Batched decode throughput of the target: one AR step (forward + cache commit) vs batch size.

    python -m bench.decode_throughput [--model smollm2] [--batch 1,8,32,64] [--cache 256]
                                      [--repeats 10] [--json PATH]

Every row of the batch has a committed prefix of half the cache, as in the middle of a batched
generation (serving, or the distillation data stage, which decodes 32-64 responses at a time).
Reports the median step time and tokens per second. Attention over the cache is the part of the
step that grows with batch x cache length; on XLA:CPU its cost depends on the cache layout (see
ssd_jax/models/attention.py).
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from bench.timing import emit, median_ms


def step_ms(runner, batch: int, cache_len: int, repeats: int) -> float:
    # Like ssd_jax.distill.measure.decode_latency but batched; it uses only the runner, forward
    # and commit, so this file also runs against older checkouts for before/after tables.
    from ssd_jax.models import causal_mask
    from ssd_jax.models.transformer import commit
    prefix = jnp.full((batch,), cache_len // 2, jnp.int32)
    mask = causal_mask(batch, 1)
    state = {"tok": jnp.ones((batch, 1), jnp.int32), "cache": runner.new_cache(batch, cache_len)}

    def step():  # one greedy AR step: forward, pick the token, commit its K/V (donated cache)
        logits, new = runner.forward(state["tok"], prefix[:, None], state["cache"], prefix, mask)
        state["tok"] = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
        state["cache"] = commit(state["cache"], new, prefix)
        jax.block_until_ready((state["tok"], state["cache"]))

    return median_ms(step, repeats, warmup=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", default="1,8,32,64", help="comma-separated batch sizes")
    ap.add_argument("--cache", type=int, default=256, help="cache slots per row (prefix = half)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        ap.error(f"--batch {args.batch!r}: give comma-separated integers, e.g. 1,8,32")
    if min(batches) < 1 or args.cache < 2 or args.repeats < 1:
        ap.error("batch sizes and --repeats must be >= 1 and --cache >= 2")
    from ssd_jax.loading import load
    from ssd_jax.core.runner import ModelRunner
    runner = ModelRunner(load(args.model)[0])
    rows = []
    for b in batches:
        ms = step_ms(runner, b, args.cache, args.repeats)
        rows.append({"batch": b, "step_ms": ms, "tok_s": 1e3 * b / ms})
        print(f"  batch {b:4d}  {ms:8.1f} ms/step  {rows[-1]['tok_s']:7.1f} tok/s",
              file=sys.stderr, flush=True)
    emit(["batch", "ms per step", "tok/s"],
         [[str(r["batch"]), f"{r['step_ms']:.1f}", f"{r['tok_s']:.1f}"] for r in rows],
         args.json, {"model": args.model, "cache": args.cache, "rows": rows,
                     "backend": jax.default_backend()},
         caption=f"cache {args.cache}, prefix {args.cache // 2}, {jax.device_count()} "
                 f"{jax.default_backend()} device(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
