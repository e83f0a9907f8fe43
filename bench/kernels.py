"""Timing table: the Pallas tree-attention kernel vs the XLA reference (jnp `attend` under jit).

Sweeps prefix length x tree size (T = U) x batch x dtype at one attention shape (default the
Llama-3-8B layer: 32 query / 8 KV heads, head_dim 128) and writes a markdown table and JSON:

    python bench/kernels.py --out results/kernels          # on a GPU/TPU, ~2 minutes
    python bench/kernels.py --interpret --prefix 64 --tree 1 8 --batch 1 --iters 2   # CPU smoke

Each row is one attention call (one layer). Times are medians of --iters calls, each waited for,
after a warm-up call that compiles; compile time is reported separately. "GB/s" is the prefix
K/V bytes the kernel must read divided by its time: decode attention is bandwidth-bound, so this
against the device's HBM bandwidth says how close the kernel gets. max_err is vs the reference.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for kernels.md and kernels.json")
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 2048, 8192, 32768],
                   help="committed prefix lengths (the cache holds exactly this many slots)")
    p.add_argument("--tree", type=int, nargs="+", default=[1, 8, 16, 64],
                   help="new tokens T = U (1 = plain decode; tree mask otherwise)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"],
                   choices=["bfloat16", "float32"])
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    p.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    p.add_argument("--backend", default="auto", choices=["auto", "gpu", "tpu"])
    p.add_argument("--block-kv", type=int, default=None, help="default: the backend's")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--interpret", action="store_true", help="interpret the kernel (CPU smoke)")
    return p.parse_args(argv)


def tree_mask(rng, T: int):
    """A random tree of T tokens (parent[u] uniform over {root, 0..u-1}): u sees its ancestors."""
    import numpy as np

    parent = rng.integers(-1, np.arange(T))
    mask = np.zeros((T, T), bool)
    for u in range(T):
        a = u
        while a >= 0:
            mask[u, a], a = True, parent[a]
    return mask


def time_fn(fn, args, iters: int) -> tuple[float, float, object]:
    """(compile+first-call seconds, median ms per call, output)."""
    t0 = time.perf_counter()
    out = fn(*args)
    out.block_until_ready()
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(times), out


def run(args: argparse.Namespace):
    """Yields one result row per configuration."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.tree_attention import tree_attention
    from ssd_jax.models.attention import attend, select_attention

    Hq, Hkv = args.heads
    D = args.head_dim
    if args.backend == "auto":  # the lowering the models would run here
        kernel = select_attention("pallas-interpret" if args.interpret else "pallas")
    else:
        kernel = functools.partial(tree_attention, backend=args.backend, interpret=args.interpret)
    kernel = jax.jit(functools.partial(kernel, block_kv=args.block_kv))
    reference = jax.jit(attend)
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    for dtype in map(jnp.dtype, args.dtype):
        for B in args.batch:
            for S in args.prefix:
                # The cache is made on device once per (dtype, B, S): at B=8, S=32768 it is 1 GiB
                # per tensor, too slow to draw with numpy for every tree size.
                key, k1, k2 = jax.random.split(key, 3)
                cache = [jax.random.normal(k, (B, Hkv, S, D), dtype) for k in (k1, k2)]
                prefix_len = jnp.full((B,), S, jnp.int32)
                for T in args.tree:
                    rnd = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
                    mask = jnp.asarray(np.broadcast_to(tree_mask(rng, T), (B, T, T)))
                    inputs = (rnd(B, T, Hq, D), *cache, prefix_len, rnd(B, T, Hkv, D),
                              rnd(B, T, Hkv, D), mask)
                    k_first, k_ms, k_out = time_fn(kernel, inputs, args.iters)
                    r_first, r_ms, r_out = time_fn(reference, inputs, args.iters)
                    err = float(jnp.max(jnp.abs(k_out.astype(jnp.float32)
                                                - r_out.astype(jnp.float32))))
                    kv_bytes = 2 * B * S * Hkv * D * dtype.itemsize
                    yield dict(dtype=dtype.name, B=B, prefix=S, T=T, kernel_ms=k_ms,
                               xla_ms=r_ms, speedup=r_ms / k_ms,
                               kernel_GBps=kv_bytes / (k_ms * 1e-3) / 1e9,
                               kernel_compile_s=k_first, xla_compile_s=r_first, max_err=err)
                del cache


COLUMNS = ("dtype", "B", "prefix", "T", "kernel_ms", "xla_ms", "speedup", "kernel_GBps",
           "max_err")


def format_row(r: dict) -> str:
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    return "| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |"


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + [format_row(r) for r in rows]) + "\n"


def describe(args: argparse.Namespace) -> tuple[str, dict]:
    """The table's header line and the run's metadata (device, jax, arguments)."""
    import jax

    device = jax.devices()[0]
    header = (f"Tree attention, Hq={args.heads[0]} Hkv={args.heads[1]} D={args.head_dim}, "
              f"one layer per call; {device.device_kind} ({jax.default_backend()}), "
              f"jax {jax.__version__}, backend={args.backend}"
              + (", INTERPRETED" if args.interpret else ""))
    meta = dict(header=header, device=device.device_kind, platform=jax.default_backend(),
                jax=jax.__version__, args={k: str(v) for k, v in vars(args).items()})
    return header, meta


def main(argv=None) -> None:
    args = parse_args(argv)
    header, meta = describe(args)
    print(markdown([], header), end="", flush=True)
    rows = []
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    for row in run(args):
        rows.append(row)
        print(format_row(row), flush=True)
        if args.out is not None:  # after every row, so a run cut short still leaves a table
            (args.out / "kernels.md").write_text(markdown(rows, header))
            (args.out / "kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows),
                                                              indent=1))
    if args.out is not None:
        print(f"wrote {args.out / 'kernels.md'} and {args.out / 'kernels.json'}")


if __name__ == "__main__":
    main()
