"""How penalties move speculation: tokens per round (and SSD's cache hit rate) with no
penalty, repetition 1.1, and presence + frequency 0.5, on one batch of prompts.

    python -m bench.penalty_acceptance [--pair smollm2|qwen2.5-coder] [--mode sd|ssd]
                                       [--k 4] [--max-tokens 64] [--json PATH]

Greedy, four prompts (two code, one explanation, one poem) in one batch, the target's
penalties on every row, one process (driver "single": SSD's two sides take turns, which
changes its speed, not what it accepts). A penalised target disagrees more with a draft that
proposes without penalties; the draft proposes with them (speculation.steer). Tokens per
round count what a round emits per row (accepted drafts + 1) and the hit rate how often the
speculation verified came from SSD's cache: neither depends on the machine's speed.
"""
from __future__ import annotations

import argparse
import sys

from bench.timing import emit

PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain how a hash map works.", "Write a haiku about autumn.",
           "Write a function that merges two sorted lists in Python."]
SETTINGS = {"none": {}, "repetition 1.1": dict(repetition_penalty=1.1),
            "presence + frequency 0.5": dict(presence_penalty=0.5, frequency_penalty=0.5)}
PAIRS = {"smollm2": ("smollm2", "smollm2-draft", None),
         "qwen2.5-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 32768)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="smollm2", choices=sorted(PAIRS))
    ap.add_argument("--mode", default="sd", choices=("sd", "ssd"))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.k < 1 or args.max_tokens < 1:
        ap.error("--k and --max-tokens must be >= 1")
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    target, draft, head = PAIRS[args.pair]
    llm = LLM(target, draft=draft, spec=SpecConfig(k=args.k, budget=3 * (args.k + 1)),
              progress=False,
              engine=EngineConfig(max_batch=len(PROMPTS), driver="single", draft_vocab=head))
    rows = []
    for name, kw in SETTINGS.items():
        m = llm.generate(PROMPTS, SamplingParams(max_new_tokens=args.max_tokens, **kw),
                         mode=args.mode)[0].metrics
        rows.append({"penalty": name, "tokens_per_round": m.tokens_per_round,
                     "acceptance": m.acceptance, "rounds": sum(m.accept_hist),
                     "hit_rate": None if m.ssd is None else m.ssd.hit_rate})
        print(f"  {name}: {m.tokens_per_round:.2f} tokens/round", file=sys.stderr, flush=True)
    emit(["penalty", "tokens per round", "acceptance", "hit rate"],
         [[r["penalty"], f"{r['tokens_per_round']:.2f}", f"{r['acceptance']:.3f}",
           "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"] for r in rows], args.json,
         {"pair": args.pair, "mode": args.mode, "k": args.k, "max_tokens": args.max_tokens,
          "rows": rows},
         caption=f"{args.pair}, greedy {args.mode.upper()}, K={args.k}, {len(PROMPTS)} prompts "
                 f"x {args.max_tokens} tokens in one batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
