"""How the target's sampling settings move speculation, and what steering the draft recovers:
tokens per round (and SSD's cache hit rate) with no setting, repetition 1.1, presence +
frequency 0.5, a logit bias that bans the plain answers' most frequent tokens, and min_tokens
holding the end of text back for the whole answer; one batch of prompts.

    python -m bench.steering_acceptance [--pair smollm2|qwen2.5-coder] [--mode sd|ssd]
                                        [--k 4] [--max-tokens 64] [--ban 4] [--json PATH]

Greedy, four prompts (two code, one explanation, one poem that ends early) in one batch, the
setting on every row, one process (driver "single": SSD's two sides take turns, which changes
its speed, not what it accepts). A target whose law a setting moves disagrees more with a
draft that proposes from its plain logits; the draft proposes from logits moved the same way
(speculation.steer). Tokens per round count what a round emits per row (accepted drafts + 1)
and the hit rate how often the speculation verified came from SSD's cache: neither depends on
the machine's speed. Run against an older commit, the same script shows what the steering
gained.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from bench.timing import emit

PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain how a hash map works.", "Write a haiku about autumn.",
           "Write a function that merges two sorted lists in Python."]
PENALTIES = {"repetition 1.1": dict(repetition_penalty=1.1),
             "presence + frequency 0.5": dict(presence_penalty=0.5, frequency_penalty=0.5)}
PAIRS = {"smollm2": ("smollm2", "smollm2-draft", None),
         "qwen2.5-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 32768)}


def banned(answers: list[list[int]], n: int) -> dict[int, float]:
    """A logit bias of -100 (OpenAI's floor: never chosen) on the n tokens the answers use most."""
    counts = Counter(t for a in answers for t in a)
    return {t: -100.0 for t, _ in counts.most_common(n)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="smollm2", choices=sorted(PAIRS))
    ap.add_argument("--mode", default="sd", choices=("sd", "ssd"))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ban", type=int, default=4, help="tokens the logit-bias setting bans")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.k < 1 or args.max_tokens < 1 or args.ban < 1:
        ap.error("--k, --max-tokens and --ban must be >= 1")
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    target, draft, head = PAIRS[args.pair]
    llm = LLM(target, draft=draft, spec=SpecConfig(k=args.k, budget=3 * (args.k + 1)),
              progress=False,
              engine=EngineConfig(max_batch=len(PROMPTS), driver="single", draft_vocab=head))
    rows = []

    def run(name, **kw):
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=args.max_tokens, **kw),
                            mode=args.mode)
        m = outs[0].metrics
        rows.append({"setting": name, "tokens_per_round": m.tokens_per_round,
                     "acceptance": m.acceptance, "rounds": sum(m.accept_hist),
                     "hit_rate": None if m.ssd is None else m.ssd.hit_rate,
                     "answer_tokens": [len(o.token_ids) for o in outs]})
        print(f"  {name}: {m.tokens_per_round:.2f} tokens/round", file=sys.stderr, flush=True)
        return outs

    plain = run("none")
    for name, kw in PENALTIES.items():
        run(name, **kw)
    bias = banned([o.token_ids for o in plain], args.ban)
    run(f"logit_bias: {len(bias)} most used tokens banned", logit_bias=bias)
    run(f"min_tokens={args.max_tokens}", min_tokens=args.max_tokens)
    emit(["setting", "tokens per round", "acceptance", "hit rate"],
         [[r["setting"], f"{r['tokens_per_round']:.2f}", f"{r['acceptance']:.3f}",
           "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"] for r in rows], args.json,
         {"pair": args.pair, "mode": args.mode, "k": args.k, "max_tokens": args.max_tokens,
          "banned": sorted(bias), "rows": rows},
         caption=f"{args.pair}, greedy {args.mode.upper()}, K={args.k}, {len(PROMPTS)} prompts "
                 f"x {args.max_tokens} tokens in one batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
