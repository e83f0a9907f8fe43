"""Convert an HF directory or a GGUF file (or a model name) into an ssd_jax orbax checkpoint.

    python -m ssd_jax.convert SRC DST [--dtype float32|bfloat16] [--force]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ssd_jax.loading import load
from ssd_jax.loading.orbax_ckpt import is_orbax_dir, save

log = logging.getLogger("ssd_jax.convert")  # not __name__: "__main__" under python -m


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssd_jax.convert", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="HF directory, .gguf file, orbax dir, or a name such as 'smollm2'")
    ap.add_argument("dst", help="output directory for the orbax checkpoint")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--force", action="store_true", help="replace an existing DST checkpoint")
    args = ap.parse_args(argv)
    from ssd_jax.__main__ import quiet_logging
    quiet_logging()
    dst = Path(args.dst)
    # Check DST before the (slow) load, and never write over something that is not ours.
    if dst.exists() and not dst.is_dir():
        return _fail(f"{dst} exists and is a file: give a directory path for the checkpoint")
    if dst.is_dir() and any(dst.iterdir()):
        if not is_orbax_dir(dst):
            return _fail(f"{dst} is a non-empty directory that is not an ssd_jax checkpoint: "
                         "give a new or empty directory")
        if not args.force:
            return _fail(f"{dst} already holds a checkpoint: pass --force to replace it, or "
                         "give another directory")
    t0 = time.perf_counter()
    try:
        model, tokenizer, extra = load(args.src, dtype=args.dtype, progress=True)
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    log.info("loaded %s (%s, %d layers) in %.1fs; writing orbax checkpoint ...", args.src,
             model.config.arch, model.config.num_layers, time.perf_counter() - t0)
    out = save(model, tokenizer, args.dst, extra=extra)
    log.info("wrote %s in %.1fs", out, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
