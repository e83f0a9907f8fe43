"""Target verification cost vs number of scored tokens (CPU or accelerator).

    python -m bench.verify_cost [--model smollm2] [--max-k 8] [--cache 512] [--json PATH]
                                [--core N] [--no-cpu-kernels] [--precision bf16]

Times the jitted target forward over T = 1..K+1 new tokens after a committed prefix (what an AR
step and an SD/SSD verification cost), warmed up, median of repeats. On this CPU small-M matrix
products by XLA's GEMM cost nearly as much per row as the first, so T tokens cost far more
than one; ssd-jax's CPU kernel (ssd_jax/kernels/cpu.py, on by default) streams the weights
once for a few rows. `--no-cpu-kernels` times XLA's products; `--core N` pins this process to
one core (the bench's protocol for the target).
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from bench.timing import emit, median_ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--cache", type=int, default=512, help="cache length (prefix = half)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument("--core", type=int, default=None, help="pin this process to one core")
    ap.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                    help="XLA's matrix products, not ssd-jax's CPU kernel")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="the CPU kernel's form (bf16: a draft's cheaper one)")
    args = ap.parse_args(argv)
    if args.max_k < 0 or args.repeats < 1 or args.cache < 2 * (args.max_k + 1):
        ap.error(f"--max-k {args.max_k}, --repeats {args.repeats}, --cache {args.cache}: need "
                 "max-k >= 0, repeats >= 1 and a cache of at least 2(max-k+1) slots (the prefix "
                 "fills half)")
    if args.core is not None:
        from ssd_jax.runtime.procs import pin_process
        pin_process({args.core})
    from ssd_jax.xla_cpu import prefer_wide_vectors
    prefer_wide_vectors()  # as the CLI, bench and workers do, before JAX's backend starts
    from ssd_jax.loading import load
    from ssd_jax.models import causal_mask
    from ssd_jax.core.runner import ModelRunner
    runner = ModelRunner(load(args.model)[0], cpu_kernels=args.cpu_kernels,
                         precision=args.precision)
    cache = runner.new_cache(1, args.cache)
    prefix = jnp.array([args.cache // 2])
    rows = []
    for t in range(1, args.max_k + 2):
        toks = jnp.ones((1, t), jnp.int32)
        pos = prefix[:, None] + jnp.arange(t)
        mask = causal_mask(1, t)
        ms = median_ms(lambda: jax.block_until_ready(runner.forward(toks, pos, cache, prefix, mask)),
                       args.repeats)
        rows.append({"tokens": t, "ms": ms})
        print(f"  T={t:2d}  {ms:7.2f} ms  ({ms / rows[0]['ms']:.2f}x)", file=sys.stderr, flush=True)
    emit(["tokens scored (K+1)", "ms", "vs 1 token"],
         [[str(r["tokens"]), f"{r['ms']:.1f}", f"{r['ms'] / rows[0]['ms']:.2f}x"] for r in rows],
         args.json, {"model": args.model, "cache": args.cache, "rows": rows,
                     "backend": jax.default_backend(), "core": args.core,
                     "cpu_kernel": runner.packed,
                     "precision": args.precision if runner.packed else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
