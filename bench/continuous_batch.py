"""Offline `generate` past max_batch: one continuous batch against consecutive batches.

    python -m bench.continuous_batch [--model smollm2] [--draft PATH] [--mode ar]
                                     [--suite chat] [--prompts 16] [--max-batch 4]
                                     [--max-tokens 16,128] [--repeats 2] [--json PATH]
                                     [--driver single|processes]

One workload, a suite's prompts with budgets spread evenly over --max-tokens (low,high) and
their natural end (EOS), decoded by `LLM.generate` in one call, both ways: with
EngineConfig(continuous=True) rows join a batch of max_batch slots as others end
(ssd_jax/continuous.py); with continuous=False they run as consecutive batches of max_batch
rows, each waiting for its longest row. Both ways warm up first (compiles apart), then run in
alternation --repeats times (timings drift on a shared VM: an A/B pair is run back to back).
Greedy answers must be equal both ways; the run fails otherwise. --driver processes decodes in
the two pinned worker processes (SSD on CPU: the target on one core, the draft on the other;
each way has its own pair of workers, idle while the other way runs).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax

from bench.suites import SUITES, load_suite
from bench.timing import emit


def budgets(n: int, low: int, high: int) -> list[int]:
    """n budgets spread evenly over [low, high], interleaved so batches mix short and long."""
    ladder = [round(low + (high - low) * i / max(n - 1, 1)) for i in range(n)]
    return ladder[0::2] + ladder[1::2][::-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default=None, help="a draft (SD/SSD modes)")
    ap.add_argument("--mode", default="ar", choices=("ar", "sd", "ssd"))
    ap.add_argument("--suite", default="chat", choices=SUITES)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-tokens", default="16,128", help="low,high budgets")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--driver", default="single", choices=("single", "processes"))
    args = ap.parse_args(argv)
    try:
        low, high = (int(x) for x in args.max_tokens.split(","))
    except ValueError:
        ap.error(f"--max-tokens {args.max_tokens!r}: give low,high, e.g. 16,128")
    if min(low, args.prompts, args.max_batch, args.repeats) < 1 or high < low:
        ap.error("--prompts, --max-batch, --repeats and budgets must be >= 1, low <= high")
    if args.mode != "ar" and args.draft is None:
        ap.error(f"--mode {args.mode} needs --draft")
    from ssd_jax import LLM, EngineConfig, SamplingParams
    texts = [p.text for p in load_suite(args.suite, args.prompts)]
    params = [SamplingParams(max_new_tokens=n) for n in budgets(args.prompts, low, high)]
    ways = {way: LLM(args.model, draft=args.draft, progress=False,
                     engine=EngineConfig(max_batch=args.max_batch, driver=args.driver,
                                         continuous=way == "continuous"))
            for way in ("continuous", "consecutive")}
    answers, seconds = {}, {w: [] for w in ways}
    for way, llm in ways.items():
        print(f"  warming up ({way})", file=sys.stderr, flush=True)
        answers[way] = [o.token_ids for o in llm.generate(texts, params, mode=args.mode)]
    for r in range(args.repeats):
        for way, llm in ways.items():
            t0 = time.perf_counter()
            out = llm.generate(texts, params, mode=args.mode)
            seconds[way].append(time.perf_counter() - t0)
            if [o.token_ids for o in out] != answers[way]:
                raise SystemExit(f"{way}: answers changed between runs")
            print(f"  repeat {r + 1} {way}: {seconds[way][-1]:.1f} s", file=sys.stderr,
                  flush=True)
    if answers["continuous"] != answers["consecutive"]:
        raise SystemExit("the continuous batch's answers differ from the consecutive batches'")
    tokens = sum(len(a) for a in answers["continuous"])
    rows = {w: {"seconds": statistics.median(s), "runs": s,
                "tok_s": tokens / statistics.median(s)} for w, s in seconds.items()}
    ratio = rows["consecutive"]["seconds"] / rows["continuous"]["seconds"]
    emit(["way", "seconds (median)", "tok/s"],
         [[w, f"{r['seconds']:.1f}", f"{r['tok_s']:.1f}"] for w, r in rows.items()],
         args.json, {"model": args.model, "draft": args.draft, "mode": args.mode,
                     "suite": args.suite, "prompts": args.prompts, "driver": args.driver,
                     "max_batch": args.max_batch, "budgets": [p.max_new_tokens for p in params],
                     "tokens": tokens, "rows": rows, "speedup": ratio,
                     "backend": jax.default_backend(), "devices": jax.device_count()},
         caption=f"{args.mode.upper()} ({args.driver}), {args.prompts} {args.suite} prompts, "
                 f"budgets {low}..{high}, max_batch {args.max_batch}, {tokens} tokens; continuous "
                 f"{ratio:.2f}x consecutive")
    return 0


if __name__ == "__main__":
    sys.exit(main())
