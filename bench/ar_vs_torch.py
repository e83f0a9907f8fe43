"""AR decoding of SmolLM2-135M-Instruct on CPU: ssd_jax vs transformers (torch), same run.

    python -m bench.ar_vs_torch [--new-tokens 128] [--threads N]

Batch 1, greedy, a few chat prompts, decode tok/s with prefill excluded (both engines: time from
the first generated token to the last). The torch side is a plain decode loop over transformers'
model and KV cache (no `generate` overhead): the strongest torch AR baseline we found here. Both engines use the same dequantised fp32 weights
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
    """Greedy decode with transformers' model and its KV cache, one forward per token (the
    same loop as ours: no EOS suppression, argmax each step); decode time excludes prefill."""
    import torch
    import transformers
    from ssd_jax.loading import smollm2_gguf
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    rates, outs = [], []
    for i, p in enumerate([prompts[0]] + prompts):  # the first one is a warm-up
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                               add_special_tokens=False)
        with torch.inference_mode():
            out = model(torch.tensor([ids]), use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            toks = [int(tok)]
            t0 = time.perf_counter()
            for _ in range(n - 1):
                out = model(tok, past_key_values=cache, use_cache=True)
                cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(int(tok))
            rate = (n - 1) / (time.perf_counter() - t0)
        if i:
            rates.append(rate)
            outs.append(toks)
            print(f"  torch {rate:6.1f} tok/s  {p[:40]!r}", file=sys.stderr)
    return rates, outs


def _child(engine: str, n: int, threads: int) -> dict:
    """Run one engine in a fresh process: JAX's and torch's thread pools in one process
    slowed torch several-fold here, which would make the comparison unfair."""
    import subprocess
    out = subprocess.run([sys.executable, "-m", "bench.ar_vs_torch", "--engine", engine,
                          "--new-tokens", str(n), "--threads", str(threads)],
                         capture_output=True, text=True, check=True)
    sys.stderr.write("".join(l + "\n" for l in out.stderr.splitlines() if "tok/s" in l))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--engine", choices=["both", "jax", "torch"], default="both")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.threads < 1:
        ap.error(f"--new-tokens {args.new_tokens} / --threads {args.threads}: need at least 2 "
                 "new tokens (decode speed excludes the first) and 1 thread")
    if args.engine != "both":
        import torch
        torch.set_num_threads(args.threads)
        if args.engine == "jax":
            rates, outs, _ = run_jax(PROMPTS, args.new_tokens)
        else:
            from ssd_jax.loading import load
            rates, outs = run_torch(PROMPTS, args.new_tokens, load("smollm2")[1])
        print(json.dumps({"rates": rates, "outs": outs}))
        return 0
    jx = _child("jax", args.new_tokens, args.threads)
    th = _child("torch", args.new_tokens, args.threads)
    import statistics as st

    import jax
    import torch
    j, t = st.mean(jx["rates"]), st.mean(th["rates"])
    same = sum(a == b for a, b in zip(jx["outs"], th["outs"]))
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
