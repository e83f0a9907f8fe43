"""Convert an HF directory or a GGUF file (or a model name) into an ssd_jax orbax checkpoint.

    python -m ssd_jax.convert SRC DST [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import sys
import time

from ssd_jax.loading import load
from ssd_jax.loading.orbax_ckpt import save


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssd_jax.convert", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="HF directory, .gguf file, orbax dir, or a name such as 'smollm2'")
    ap.add_argument("dst", help="output directory for the orbax checkpoint")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        model, tokenizer, extra = load(args.src, dtype=args.dtype, progress=True)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[convert] loaded {args.src} ({model.config.arch}, {model.config.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s; writing orbax checkpoint ...", file=sys.stderr)
    out = save(model, tokenizer, args.dst, extra=extra)
    print(f"[convert] wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
