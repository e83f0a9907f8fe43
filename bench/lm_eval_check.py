"""lm-evaluation-harness against the server, checked against transformers.

lm-eval's `local-completions` model talks to an OpenAI completions server with token-id
prompts, several per request (`--batch_size`). For log-likelihood tasks it sends `echo`,
`logprobs: 1`, `max_tokens: 1` and reads the continuation's `token_logprobs` and whether each
token was the top one; for generation tasks it sends greedy requests with stop strings. This
script runs both kinds, a small multiple-choice task and a small generation task written here,
through `lm_eval` against `ssd-serve` (SSD, SmolLM2 and its draft), then recomputes every
answer independently with transformers from the same GGUF: each log-likelihood as the sum of
log_softmax over the continuation (tokenised as lm-eval tokenises a context/continuation pair)
and each generation as transformers' greedy continuation cut at the stop string.

lm-eval is not a dependency of ssd-jax: install it in a virtual environment of its own
(`pip install "lm_eval[api]"`) and pass its executable with --lm-eval. Nothing is downloaded:
the tasks read local files, and lm-eval tokenizes through the server's /tokenize and
/detokenize (`tokenizer_backend=remote`; `--tokenizer hf` gives it a Hugging Face tokenizer
written from the GGUF instead). The oracle tokenizes with transformers' own tokenizer.

    python -m bench.lm_eval_check --lm-eval /path/to/venv/bin/lm_eval
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# Small tasks: a minute or two on a 2-core CPU. Choices and targets carry no leading space
# (lm-eval puts its target delimiter, a space, between context and continuation).
MC = [("What is the capital of France?", ["Paris", "London", "Rome", "Berlin"], 0),
      ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
      ("Which planet is known as the Red Planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
      ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
      ("What colour is the sky on a clear day?", ["green", "blue", "red", "black"], 1)]
GEN = [("The capital of France is", "Paris"), ("One, two, three,", "four"),
       ("The opposite of hot is", "cold"), ("def add(a, b):\n    return", "a + b")]
TASK_HEAD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
MC_TASK = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: %d
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
LL_ATOL = 1e-3  # a continuation's log-likelihood, summed over its tokens, in nats


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.lm_eval_check",
                                 description=__doc__.splitlines()[0])
    a = ap.add_argument
    a("--lm-eval", default="lm_eval", help="the lm_eval executable (its own virtual env)")
    a("--mode", default="ssd", choices=["ar", "sd", "ssd"])
    a("--batch-size", type=int, default=4, help="prompts per request lm-eval sends")
    a("--max-tokens", type=int, default=16, help="generation task's max_gen_toks")
    a("--tokenizer", default="remote", choices=["remote", "hf"],
      help="lm-eval's tokenizer: the server's endpoints, or an HF copy from the GGUF")
    a("--out", default=None, help="directory for lm-eval's output (default: a temporary one)")
    return ap


def hf_tokenizer():
    import transformers
    from ssd_jax.loading import smollm2_gguf
    gguf = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def write_inputs(work: Path, max_tokens: int) -> Path:
    """The two tasks and their data, and an HF tokenizer directory from the GGUF (used with
    --tokenizer hf)."""
    tasks = work / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    with open(tasks / "mc.jsonl", "w") as f:
        for q, choices, answer in MC:
            f.write(json.dumps(dict(question=q, choices=choices, answer=answer)) + "\n")
    with open(tasks / "gen.jsonl", "w") as f:
        for prompt, target in GEN:
            f.write(json.dumps(dict(prompt=prompt, target=target)) + "\n")
    (tasks / "ssd_mc.yaml").write_text(TASK_HEAD.format(name="ssd_mc", data=tasks / "mc.jsonl")
                                       + MC_TASK)
    (tasks / "ssd_gen.yaml").write_text(TASK_HEAD.format(name="ssd_gen",
                                                         data=tasks / "gen.jsonl")
                                        + GEN_TASK % max_tokens)
    hf_tokenizer().save_pretrained(work / "tokenizer")
    return tasks


def run_lm_eval(args, url: str, work: Path, tasks: Path) -> dict[str, list[dict]]:
    """lm_eval's per-sample records, by task."""
    out = Path(args.out or work / "out")
    tokenizer = ("tokenizer_backend=remote" if args.tokenizer == "remote" else
                 f"tokenizer={work / 'tokenizer'},tokenizer_backend=huggingface")
    model_args = (f"model=smollm2,base_url={url}/v1/completions,{tokenizer},"
                  "tokenized_requests=True,max_retries=1,num_concurrent=1")
    cmd = [args.lm_eval, "--model", "local-completions", "--model_args", model_args,
           "--tasks", "ssd_mc,ssd_gen", "--include_path", str(tasks),
           "--batch_size", str(args.batch_size), "--output_path", str(out), "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    print("lm_eval_check: running", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval_check: lm_eval exited with {done.returncode} (its output "
                         "is above)")
    samples = {}
    for task in ("ssd_mc", "ssd_gen"):
        files = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
        if not files:
            raise SystemExit(f"lm_eval_check: lm_eval wrote no samples for {task} under {out}")
        samples[task] = [json.loads(line) for line in open(files[-1])]
    return samples


class Oracle:
    """transformers' SmolLM2 and its tokenizer, from the same GGUF."""

    def __init__(self):
        import torch
        import transformers
        from ssd_jax.loading import smollm2_gguf
        gguf = smollm2_gguf()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        self.tok = hf_tokenizer()

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As lm-eval's TemplateLM._encode_pair: trailing spaces of the context move to the
        continuation, the pair is encoded whole, and the context's own encoding's length
        splits it."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole = self.tok.encode(context + continuation, add_special_tokens=False)
        ctx = self.tok.encode(context, add_special_tokens=False)
        return whole[:len(ctx)], whole[len(ctx):]

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        ctx, cont = self.encode_pair(context, continuation)
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([ctx + cont])).logits[0].double()
        lp = self.torch.log_softmax(logits[len(ctx) - 1:-1], -1).numpy()
        picked = lp[np.arange(len(cont)), cont]
        return float(picked.sum()), bool((lp.argmax(-1) == np.asarray(cont)).all())

    def greedy(self, prompt: str, max_tokens: int, stop: str) -> str:
        ids = self.tok.encode(prompt, add_special_tokens=False)
        with self.torch.no_grad():
            out = self.model.generate(self.torch.tensor([ids]), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=self.tok.eos_token_id)
        text = self.tok.decode(out[0, len(ids):], skip_special_tokens=True)
        return text.split(stop)[0]


def compare(samples: dict[str, list[dict]], oracle: Oracle, max_tokens: int) -> dict:
    """Every lm-eval answer against the oracle's; returns the report."""
    lls, worst, greedy_same, mc_ok = [], 0.0, 0, 0
    for s in samples["ssd_mc"]:
        for (got_ll, got_greedy), args in zip(s["filtered_resps"], s["arguments"].values()):
            want_ll, want_greedy = oracle.loglikelihood(args["arg_0"], args["arg_1"])
            worst = max(worst, abs(float(got_ll) - want_ll))
            greedy_same += (got_greedy == "True") == want_greedy
            lls.append((float(got_ll), want_ll))
        mc_ok += s["acc"]
    gens = []
    for s in samples["ssd_gen"]:
        prompt = s["arguments"]["gen_args_0"]["arg_0"]
        gens.append((s["filtered_resps"][0], oracle.greedy(prompt, max_tokens, "\n")))
    report = dict(
        loglikelihoods=len(lls), max_abs_diff=worst, within_atol=worst <= LL_ATOL,
        is_greedy_agree=f"{greedy_same}/{len(lls)}", mc_acc=mc_ok / len(samples["ssd_mc"]),
        generations=len(gens), generations_equal=sum(g == w for g, w in gens),
        mismatched=[dict(lm_eval=g, transformers=w) for g, w in gens if g != w])
    return report


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from bench.serve_load import start_server
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tasks = write_inputs(work, args.max_tokens)
        server_args = argparse.Namespace(pair="smollm2", slots=args.batch_size, max_queue=64,
                                         k=None, draft_vocab=None, pin=False)
        proc, url = start_server(server_args, args.mode)
        try:
            samples = run_lm_eval(args, url, work, tasks)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        report = compare(samples, Oracle(), args.max_tokens)
    print(json.dumps(report, indent=1))
    ok = report["within_atol"] and report["generations_equal"] == report["generations"]
    print(f"lm_eval_check: {'OK' if ok else 'MISMATCH'}: {report['loglikelihoods']} "
          f"log-likelihoods within {report['max_abs_diff']:.2e} nats of transformers' "
          f"(is_greedy agrees {report['is_greedy_agree']}), {report['generations_equal']}/"
          f"{report['generations']} generations equal transformers' greedy ({args.mode}, "
          f"lm-eval batch size {args.batch_size}, {args.tokenizer} tokenizer)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
