"""Target verification cost vs number of scored tokens (CPU or accelerator).

    python -m bench.verify_cost [--model smollm2] [--max-k 8] [--cache 512] [--json PATH]

Times the jitted target forward over T = 1..K+1 new tokens after a committed prefix (what an AR
step and an SD/SSD verification cost), warmed up, median of repeats. On this CPU small-M matrix
products are compute-bound, so T tokens cost far more than one (platform notes): that ratio is
what decides the best K here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--cache", type=int, default=512, help="cache length (prefix = half)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from ssd_jax.loading import load
    from ssd_jax.models import causal_mask
    from ssd_jax.runner import ModelRunner
    runner = ModelRunner(load(args.model)[0])
    cache = runner.new_cache(1, args.cache)
    prefix = jnp.array([args.cache // 2])
    rows = []
    for t in range(1, args.max_k + 2):
        toks = jnp.ones((1, t), jnp.int32)
        pos = prefix[:, None] + jnp.arange(t)
        mask = causal_mask(1, t)
        jax.block_until_ready(runner.forward(toks, pos, cache, prefix, mask))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(runner.forward(toks, pos, cache, prefix, mask))
            times.append(time.perf_counter() - t0)
        rows.append({"tokens": t, "ms": 1e3 * statistics.median(times)})
        print(f"  T={t:2d}  {rows[-1]['ms']:7.2f} ms  ({rows[-1]['ms'] / rows[0]['ms']:.2f}x)",
              file=sys.stderr, flush=True)
    print("| tokens scored (K+1) | ms | vs 1 token |\n|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['ms']:.1f} | {r['ms'] / rows[0]['ms']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "cache": args.cache, "rows": rows,
                       "backend": jax.default_backend()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
