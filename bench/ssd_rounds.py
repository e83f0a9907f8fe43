"""SSD's rounds one by one: each round's verification and cache-build time, per prompt.

    python -m bench.ssd_rounds [--pair qwen2.5-coder] [--suite code] [--num-prompts 3]
                               [--output-len 96] [--k 4] [--budget 6] [--draft-vocab N]
                               [--draft-precision bf16] [--json PATH]

The bench's phase table gives means; this prints the rounds themselves (worker processes: the
target pinned to one core, the draft to the other, as `ssd-bench` runs SSD on a CPU), to see
whether a slow mean is every round or some. On the dev VM (2026-12-05, the Qwen pair, K=4,
M=6, bf16 draft) a prompt's verifications sat near 230 ms for runs of rounds and near 310-340
for others, where the target alone takes ~228 ms.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

PAIRS = {"qwen2.5-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
         "smollm2": ("smollm2", "smollm2-draft")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder", choices=sorted(PAIRS))
    ap.add_argument("--suite", default="code")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=6)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--draft-precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.output_len < 8:
        ap.error("--num-prompts must be >= 1 and --output-len >= 8")
    from bench import suites
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    target, draft = PAIRS[args.pair]
    prompts = [p.text for p in suites.load_suite(args.suite, args.num_prompts, seed=0)]
    llm = LLM(target, draft=draft, spec=SpecConfig(k=args.k, budget=args.budget),
              engine=EngineConfig(driver="processes", max_seq_len=1024,
                                  draft_vocab=args.draft_vocab,
                                  draft_precision=args.draft_precision), progress=False)
    rows = []
    with llm:
        # Compiles every program before the timed prompts.
        llm.generate(prompts[:1], SamplingParams(max_new_tokens=16, ignore_eos=True), mode="ssd")
        for i, text in enumerate(prompts):
            out = llm.generate([text], SamplingParams(max_new_tokens=args.output_len,
                                                      ignore_eos=True), mode="ssd")[0]
            m = out.metrics
            verify = np.asarray(m.verify_rounds) * 1e3
            build = np.asarray(m.ssd.build_rounds or []) * 1e3
            rows.append({"prompt": i, "verify_ms": verify.round(1).tolist(),
                         "build_ms": build.round(1).tolist(), "hits": m.ssd.hits,
                         "rounds": m.ssd.rounds,
                         "exposed_ms_per_round": 1e3 * m.ssd.exposed_s / max(m.ssd.rounds, 1)})
            print(f"prompt {i}: verify mean {verify.mean():.0f} median {np.median(verify):.0f} "
                  f"p10 {np.percentile(verify, 10):.0f} p90 {np.percentile(verify, 90):.0f} ms; "
                  f"build mean {build.mean():.0f} median {np.median(build):.0f} ms; hits "
                  f"{m.ssd.hits}/{m.ssd.rounds}; exposed {rows[-1]['exposed_ms_per_round']:.0f} "
                  "ms/round", flush=True)
            print("  verify ms by round: " + " ".join(f"{x:.0f}" for x in verify), flush=True)
            print("  build ms by round:  " + " ".join(f"{x:.0f}" for x in build), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "prompts": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
