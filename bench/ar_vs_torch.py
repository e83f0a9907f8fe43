"""AR decoding of SmolLM2-135M-Instruct on CPU: ssd_jax vs transformers (torch), same run.

    python -m bench.ar_vs_torch [--new-tokens 128] [--threads N]

Batch 1, greedy, a few chat prompts, decode tok/s with prefill excluded (both engines: time from
the first generated token to the last). Both engines use the same dequantised fp32 weights
(transformers loads the same GGUF) and the same number of CPU threads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

PROMPTS = ["What is the capital of France?",
           "Write a short poem about the sea.",
           "Explain what a hash table is in two sentences.",
           "Give me three tips for staying focused while studying."]


def run_jax(prompts, n):
    from ssd_jax import LLM, SamplingParams
    llm = LLM("smollm2")
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    llm.warmup(prompts[0], params)
    rates, outs = [], []
    for p in prompts:
        out = llm.generate(p, params)[0]
        rates.append(out.metrics.decode_tok_s)
        outs.append(out.token_ids)
        print(f"  jax   {out.metrics.decode_tok_s:6.1f} tok/s  {p[:40]!r}", file=sys.stderr)
    return rates, outs, llm.tokenizer


def run_torch(prompts, n, tokenizer):
    import torch
    import transformers
    from ssd_jax.loading import smollm2_gguf
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    rates, outs = [], []
    for i, p in enumerate([prompts[0]] + prompts):  # first one is a warm-up
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                               add_special_tokens=False)
        x = torch.tensor([ids])
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            t2 = time.perf_counter()
        # decode time = full generation minus a prefill+1-token generation
        rate = (n - 1) / ((t2 - t1) - (t1 - t0))
        if i:
            rates.append(rate)
            outs.append(out[0, len(ids):].tolist())
            print(f"  torch {rate:6.1f} tok/s  {p[:40]!r}", file=sys.stderr)
    return rates, outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    jax_rates, jax_outs, tok = run_jax(PROMPTS, args.new_tokens)
    torch_rates, torch_outs = run_torch(PROMPTS, args.new_tokens, tok)
    import statistics as st
    j, t = st.mean(jax_rates), st.mean(torch_rates)
    same = sum(a == b for a, b in zip(jax_outs, torch_outs))
    import jax
    res = dict(jax_tok_s=j, torch_tok_s=t, ratio=j / t, new_tokens=args.new_tokens, batch=1,
               identical_outputs=f"{same}/{len(PROMPTS)}", threads=args.threads,
               jax=jax.__version__, torch=torch.__version__, cpu=platform.processor() or
               platform.machine(), cores=os.cpu_count(), date=time.strftime("%Y-%m-%d"))
    print("| engine | decode tok/s (batch 1, greedy, %d new tokens) |" % args.new_tokens)
    print("|---|---|")
    print(f"| ssd_jax AR | {j:.1f} |\n| transformers (torch) AR | {t:.1f} |")
    print(f"ratio jax/torch = {j / t:.2f}; identical greedy outputs: {same}/{len(PROMPTS)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
