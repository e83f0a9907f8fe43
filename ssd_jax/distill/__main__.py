"""CLI: python -m ssd_jax.distill {data,train,measure} (see ssd_jax/distill/__init__.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ssd_jax.loading.registry import DEFAULT_CACHE

DATA_DIR = DEFAULT_CACHE / "distill"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssd_jax.distill",
                                 description="distil the SmolLM2 draft (offline, reproducible)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="target responses + corpus, labelled with target top-k")
    d.add_argument("--out", type=Path, default=DATA_DIR)
    d.add_argument("--gen-batches", type=int, default=40)
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--corpus-chunks", type=int, default=160)
    d.add_argument("--top-k", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    o = sub.add_parser("onpolicy", help="the draft answers fresh prompts, the target labels them")
    o.add_argument("--base", type=Path, default=DATA_DIR / "dataset.npz",
                   help="dataset.npz of the data stage; the output starts with it")
    o.add_argument("--draft", type=Path, required=True, help="draft checkpoint that answers")
    o.add_argument("--out", type=Path, default=DEFAULT_CACHE / "distill-onpolicy")
    o.add_argument("--batches", type=int, default=40)
    o.add_argument("--batch", type=int, default=32)
    o.add_argument("--max-new-tokens", type=int, default=128)
    o.add_argument("--top-k", type=int, default=16)
    o.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train", help="KD training (resumable), then export the checkpoint")
    t.add_argument("--data", type=Path, default=DATA_DIR / "dataset.npz")
    t.add_argument("--work", type=Path, default=DATA_DIR / "train")
    # Not the shipped checkpoint by default: a trial run must not replace it (`make draft`
    # passes --out checkpoints/smollm2-draft on purpose).
    t.add_argument("--out", type=Path, default=DEFAULT_CACHE / "distill-draft")
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--minutes", type=float, default=0.0,
                   help="stop early (and export) after this much wall time; 0 = no limit")
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init", type=Path, default=None,
                   help="continue this draft checkpoint (its architecture and vocabulary)")
    m = sub.add_parser("measure", help="acceptance and latency on held-out prompts")
    m.add_argument("--draft", default="smollm2-draft")
    m.add_argument("--target", default="smollm2",
                   help="e.g. --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b")
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("-K", type=int, default=5)
    m.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = ap.parse_args(argv)
    from ssd_jax.__main__ import quiet_logging
    quiet_logging()
    for flag in ("K", "max_new_tokens", "gen_batches", "batch", "batches", "steps", "top_k"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            name = "-K" if flag == "K" else "--" + flag.replace("_", "-")
            ap.error(f"{name} {value} is invalid: it must be >= 1")

    if args.cmd == "data":
        from ssd_jax.distill.data import DataConfig, build
        cfg = DataConfig(seed=args.seed, gen_batches=args.gen_batches, batch=args.batch,
                         max_new_tokens=args.max_new_tokens, corpus_chunks=args.corpus_chunks,
                         top_k=args.top_k)
        print(build(args.out, cfg))
    elif args.cmd == "onpolicy":
        from ssd_jax.distill.data import DataConfig, build_onpolicy
        cfg = DataConfig(seed=args.seed, batch=args.batch, max_new_tokens=args.max_new_tokens,
                         top_k=args.top_k)
        print(build_onpolicy(args.out, args.base, args.draft, cfg, batches=args.batches))
    elif args.cmd == "train":
        from ssd_jax.distill.train import TrainConfig, run
        cfg = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                          max_minutes=args.minutes)
        print(run(args.data, args.work, args.out, cfg, init=args.init))
    else:
        from ssd_jax.distill.measure import measure
        import json
        report = measure(args.draft, target_name=args.target, max_new_tokens=args.max_new_tokens,
                         K=args.K)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
