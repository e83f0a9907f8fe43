"""The main job: answer a chat prompt with the embedded default model pair, streaming.

    python -m ssd_jax "What is the capital of France?" [--mode ar] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import sys

from ssd_jax import LLM, SamplingParams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssd_jax", description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="?", default="What is the capital of France?")
    ap.add_argument("--model", default="smollm2", help="target: name, .gguf, HF dir or orbax dir")
    ap.add_argument("--mode", default="ar", choices=["ar"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compile_s = llm.warmup(args.prompt, params)
    print(f"> {args.prompt}", flush=True)
    for piece in llm.stream(args.prompt, params):
        print(piece, end="", flush=True)
    print()
    m = llm.last_metrics
    print(f"[{args.mode}] {m.new_tokens} tokens, TTFT {1e3 * m.ttft_s:.0f} ms, decode "
          f"{m.decode_tok_s:.1f} tok/s (compilation before the run: {compile_s:.1f}s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
