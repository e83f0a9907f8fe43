"""The accelerator check, one part per subcommand (bench/gpu_check.sh runs them, time-boxed):

    python bench/gpu_check.py kernels   --out DIR   # tree-attention kernel vs XLA timings
    python bench/gpu_check.py exactness --out DIR   # AR == SD == SSD; Pallas model == XLA model
    python bench/gpu_check.py physics   --out DIR   # step costs of real-shaped models (bf16)
    python bench/gpu_check.py predict   --out DIR   # speed model on those costs
    python bench/gpu_check.py summary   --out DIR   # part statuses into summary.json

Each part writes its markdown table after every measurement and merges its data into
DIR/summary.json, so a part stopped by its time box keeps what it measured. --dry-run: tiny
sizes on CPU, the Pallas kernel interpreted (what the default test run checks).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench import step_costs  # noqa: E402

PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8, [3, 1, 4, 1, 5, 9, 2, 6]]
MODES = ("ar", "sd", "ssd")


# ------------------------------------------------------------------ output
def update_summary(out: Path, key: str, value) -> None:
    path = out / "summary.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    tmp = out / "summary.json.part"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)  # a part killed mid-write leaves the previous summary whole


def platform_line(dry_run: bool) -> str:
    import jax
    device = jax.devices()[0]
    return (f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}"
            + (", DRY RUN (CPU, tiny sizes)" if dry_run else ""))


# ------------------------------------------------------------------ kernels
def kernels(args) -> int:
    from bench import kernels as bench_kernels
    sweep = (["--interpret", "--prefix", "64", "--tree", "1", "8", "--batch", "1", "--dtype",
              "float32", "--iters", "2"] if args.dry_run else
             ["--prefix", "1024", "8192", "32768", "--tree", "1", "8", "64", "--batch", "1",
              "8", "--dtype", "bfloat16", "--iters", "20"])
    kargs = bench_kernels.parse_args(sweep)
    header, meta = bench_kernels.describe(kargs)
    rows = []
    (args.out / "kernels.md").write_text(bench_kernels.markdown(rows, header))
    for row in bench_kernels.run(kargs):
        rows.append(row)
        print(bench_kernels.format_row(row), flush=True)
        (args.out / "kernels.md").write_text(bench_kernels.markdown(rows, header))
        update_summary(args.out, "kernels", dict(meta=meta, rows=rows))
    return 0


# ------------------------------------------------------------------ exactness
def tiny_config(dtype: str, dry_run: bool):
    from ssd_jax.config import ModelConfig
    # head_dim 64: the Triton lowering needs a power of two >= 16; GQA 2 query heads per KV head.
    # The dry run's one layer halves the CPU compile time, which is nearly all of its cost.
    return ModelConfig(arch="qwen2", vocab_size=256, hidden_size=256, intermediate_size=512,
                       num_layers=1 if dry_run else 2, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype,
                       rope_theta=1e6, max_position_embeddings=1024)


def random_model(config, seed: int, base=None, noise: float = 0.0):
    """A random model with crisp logits: the 0.02 init gives near-uniform logits, whose near-ties
    any rounding difference flips. Weights ~N(0, 0.08), biases ~N(0, 0.5) (like the HF test
    fixtures). With `base`: its weights plus N(0, noise) on every matrix (a noisy draft)."""
    import jax
    from flax import nnx
    from ssd_jax.models.transformer import Transformer
    model = Transformer(config, rngs=nnx.Rngs(seed))
    state = nnx.state(model if base is None else base, nnx.Param)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(jax.random.key(seed), len(flat))

    def draw(key, path, x):
        name = str(path[-2] if len(path) > 1 else path[-1])
        normal = jax.random.normal(key, x.shape, x.dtype)
        if base is not None:
            return x + noise * normal if x.ndim > 1 else x
        if x.ndim > 1:
            return 0.08 * normal
        return 0.5 * normal if "bias" in name else x
    nnx.update(model, jax.tree_util.tree_unflatten(
        treedef, [draw(k, p, x) for k, (p, x) in zip(keys, flat)]))
    return model


@contextlib.contextmanager
def interpreted_kernel(dry_run: bool):
    """ModelConfig(attention_backend="pallas") has no lowering on CPU, so the dry run points
    the model's one attention-selection hook at the interpreted GPU lowering (same program)."""
    if not dry_run:
        yield
        return
    from pallas_kernels.tree_attention import tree_attention
    from ssd_jax.models import transformer
    original = transformer.select_attention
    kernel = functools.partial(tree_attention, backend="gpu", interpret=True)
    transformer.select_attention = (
        lambda config: kernel if config.attention_backend == "pallas" else original(config))
    try:
        yield
    finally:
        transformer.select_attention = original


def speculation_exactness(dry_run: bool, n_new: int) -> list[dict]:
    """Greedy AR, SD and SSD on one device (single-controller driver) for batch 1 and 4 (the
    dry run: 4 only; batch 1 is the same code at another shape, and compiles are its cost)."""
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    config = tiny_config("float32", dry_run)
    target = random_model(config, 0)
    draft = random_model(config, 1, base=target, noise=0.005)
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16,
                                  driver="single"))
    p = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    rows = []
    for batch in (4,) if dry_run else (1, 4):
        t0 = time.perf_counter()
        outs = {m: llm.generate(PROMPTS[:batch], p, mode=m) for m in MODES}
        tokens = {m: [o.token_ids for o in outs[m]] for m in MODES}
        ssd = outs["ssd"][0].metrics.ssd
        rows.append(dict(batch=batch, sd_equals_ar=tokens["sd"] == tokens["ar"],
                         ssd_equals_ar=tokens["ssd"] == tokens["ar"],
                         sd_acceptance=outs["sd"][0].metrics.acceptance,
                         ssd_hits=ssd.hits, ssd_rounds=ssd.rounds,
                         tokens=sum(len(t) for t in tokens["ar"]), seconds=time.perf_counter() - t0,
                         ar=tokens["ar"], sd=tokens["sd"], ssd=tokens["ssd"]))
    return rows


def backend_agreement(dry_run: bool, n_new: int) -> dict:
    """The same bf16 weights with the Pallas kernel and with the jnp/XLA attention: logits of a
    decode step, an SD-style chain and an SSD-style tree after a filled prefix, then greedy AR."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from bench.kernels import tree_mask
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.models import causal_mask
    from ssd_jax.models.transformer import Transformer
    from ssd_jax.runner import ModelRunner
    config = tiny_config("bfloat16", dry_run)
    xla = random_model(config.replace(attention_backend="jnp"), 2)
    pallas = Transformer(config.replace(attention_backend="pallas"), rngs=nnx.Rngs(2))
    nnx.update(pallas, nnx.state(xla, nnx.Param))
    runners = {"xla": ModelRunner(xla), "pallas": ModelRunner(pallas)}
    B, prefix = 2, np.array([37, 100])
    cache = runners["xla"].fill(jnp.asarray(np.random.default_rng(0).integers(
        0, config.vocab_size, (B, 128)), jnp.int32), runners["xla"].new_cache(B, 256))
    rng = np.random.default_rng(1)
    masks = {"decode": causal_mask(B, 1), "chain": causal_mask(B, 5),
             "tree": jnp.asarray(np.stack([tree_mask(rng, 8) for _ in range(B)]))}
    if dry_run:  # each case is two CPU compiles; the tree covers the chain's code path
        del masks["chain"]
    cases = {}
    for name, mask in masks.items():
        T = mask.shape[1]
        toks = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)
        pos = jnp.asarray(prefix[:, None] + np.arange(T), jnp.int32)
        lengths = jnp.asarray(prefix, jnp.int32)
        got = {k: np.asarray(r.forward(toks, pos, cache, lengths, mask)[0])
               for k, r in runners.items()}
        ref = got["xla"]
        top2 = np.sort(ref, axis=-1)[..., -2:]
        same = got["pallas"].argmax(-1) == ref.argmax(-1)
        cases[name] = dict(max_abs_diff=float(np.abs(got["pallas"] - ref).max()),
                           max_abs_logit=float(np.abs(ref).max()),
                           argmax_agree=int(same.sum()), positions=int(same.size),
                           # a disagreement at a near-tie is rounding, not a kernel error
                           min_margin_at_disagreement=float((top2[..., 1] - top2[..., 0])[~same]
                                                            .min()) if (~same).any() else None)
    p = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    engine = EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16)
    greedy = {k: [o.token_ids for o in LLM(m, engine=engine).generate(PROMPTS, p, mode="ar")]
              for k, m in (("xla", xla), ("pallas", pallas))}
    return dict(cases=cases, greedy_equal=greedy["xla"] == greedy["pallas"],
                greedy_tokens=sum(map(len, greedy["xla"])), tol=3e-2,
                greedy_first_diff=[next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                   for x, y in zip(greedy["xla"], greedy["pallas"])])


def exactness_markdown(spec: list[dict], agree: dict | None, header: str) -> str:
    yes = lambda b: "**equal**" if b else "**DIFFERENT**"
    lines = [header, "", "Greedy AR vs SD vs SSD, tiny random fp32 Qwen2-style pair (draft = "
             "target + noise), K=3, M=8, one device, single-controller driver.", "",
             "| batch | SD vs AR | SSD vs AR | tokens | SD acceptance | SSD hits / rounds | s |",
             "|---|---|---|---|---|---|---|"]
    for r in spec:
        lines.append(f"| {r['batch']} | {yes(r['sd_equals_ar'])} | {yes(r['ssd_equals_ar'])} | "
                     f"{r['tokens']} | {r['sd_acceptance']:.2f} | {r['ssd_hits']} / "
                     f"{r['ssd_rounds']} | {r['seconds']:.1f} |")
    if agree is not None:
        lines += ["", "Pallas-kernel model vs XLA-attention model, same bf16 weights (logits "
                  f"within {agree['tol']} x max abs logit; greedy AR over {len(PROMPTS)} prompts).",
                  "", "| input | max abs diff | max abs logit | within tol | argmax agree | "
                  "min top-2 margin where not |", "|---|---|---|---|---|---|"]
        for name, c in agree["cases"].items():
            ok = c["max_abs_diff"] <= agree["tol"] * max(1.0, c["max_abs_logit"])
            lines.append(f"| {name} | {c['max_abs_diff']:.4f} | {c['max_abs_logit']:.2f} | "
                         f"{'yes' if ok else '**NO**'} | {c['argmax_agree']}/{c['positions']} | "
                         f"{c['min_margin_at_disagreement'] or '–'} |")
        lines += ["", f"Greedy tokens ({agree['greedy_tokens']}): {yes(agree['greedy_equal'])}"
                  + ("" if agree["greedy_equal"] else
                     f" (first differing step per prompt: {agree['greedy_first_diff']})")]
    return "\n".join(lines) + "\n"


def exactness(args) -> int:
    header = "# Exactness on " + platform_line(args.dry_run)
    n_new = 12 if args.dry_run else 32
    spec = speculation_exactness(args.dry_run, n_new)
    ok = all(r["sd_equals_ar"] and r["ssd_equals_ar"] for r in spec)
    update_summary(args.out, "exactness", dict(speculation=spec, backends=None))
    (args.out / "exactness.md").write_text(exactness_markdown(spec, None, header))
    with interpreted_kernel(args.dry_run):
        agree = backend_agreement(args.dry_run, 4 if args.dry_run else 16)
    ok = ok and agree["greedy_equal"] and all(
        c["max_abs_diff"] <= agree["tol"] * max(1.0, c["max_abs_logit"])
        for c in agree["cases"].values())
    update_summary(args.out, "exactness", dict(speculation=spec, backends=agree, ok=ok))
    (args.out / "exactness.md").write_text(exactness_markdown(spec, agree, header))
    print((args.out / "exactness.md").read_text())
    return 0 if ok else 1


# ------------------------------------------------------------------ physics, predictions
def physics(args) -> int:
    import jax
    small = args.dry_run
    attention = "jnp" if jax.default_backend() == "cpu" else "auto"  # auto: Pallas on GPU
    header = (f"# Step costs, bf16 random weights, batch 1 unless rows, prefix {args.context // 2}"
              f" of a {args.context}-slot cache; {platform_line(small)}")
    results, t0 = [], time.perf_counter()

    def record(r):
        if not any(r is x for x in results):
            results.append(r)
        (args.out / "physics.md").write_text(step_costs.physics_markdown(results, header))
        update_summary(args.out, "physics", dict(header=header, dry_run=small, models=results))

    def attempt(name: str, backend: str) -> bool:
        config = step_costs.model_config(name, dry_run=small, attention=backend)
        try:
            step_costs.measure(name, config, tokens=args.tokens, rows=args.rows,
                               context=args.context, repeats=args.repeats, record=record)
            return True
        except Exception as e:  # keep measuring the other models; say what broke
            entry = next((r for r in results if r["model"] == name
                          and r["attention"] == backend), None)
            if entry is None:
                entry = dict(model=name, params=0, attention=backend, decode_ms=None,
                             score_ms={}, rows_ms={})
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            record(entry)
            return False
        finally:
            jax.clear_caches()

    failed = False
    for name in args.models:
        if time.perf_counter() - t0 > args.budget_s:
            record(dict(model=name, params=0, attention="–", decode_ms=None, score_ms={},
                        rows_ms={}, error="skipped: out of time"))
            continue
        if not attempt(name, attention):
            failed = True
            if attention != "jnp":  # the kernel broke: the XLA attention still gives costs
                attempt(name, "jnp")
    print((args.out / "physics.md").read_text())
    return 1 if failed else 0


def predict(args) -> int:
    summary = json.loads((args.out / "summary.json").read_text())
    models = {m["model"]: m for m in summary.get("physics", {}).get("models", [])}
    missing = [n for n in (args.target, args.draft) if models.get(n, {}).get("decode_ms") is None
               or len(models[n]["score_ms"]) < 2]
    a = step_costs.acceptance_from_tokens(args.tokens_per_round, args.measured_k)
    header = (f"# Predicted decode speed, {args.target} target / {args.draft} draft, batch 1, "
              f"greedy, K={args.k}, M={2 * (args.k + 1)}: GPU step costs from physics "
              f"({'DRY RUN' if summary.get('physics', {}).get('dry_run') else 'measured'})"
              f"\n\nCPU-measured inputs (real pair): {args.tokens_per_round} tokens/round at "
              f"K={args.measured_k} (geometric acceptance a={a:.3f}), per-token greedy agreement "
              f"{args.agreement}. SSD hit rate: not measured for this pair, so one row per "
              f"assumed rate {args.hit_rates}. SSD assumes a second device for the draft.")
    if missing:
        (args.out / "predictions.md").write_text(
            header + f"\n\nNo prediction: physics has no step costs for {missing}.\n")
        update_summary(args.out, "predictions", dict(error=f"no step costs for {missing}"))
        return 1
    unkey = lambda m: dict(m, score_ms={int(k): v for k, v in m["score_ms"].items()})
    rows = step_costs.predict(unkey(models[args.target]), unkey(models[args.draft]), k=args.k,
                              accept=a, hit_rates=args.hit_rates)
    (args.out / "predictions.md").write_text(step_costs.predictions_markdown(rows, header))
    update_summary(args.out, "predictions", dict(
        target=args.target, draft=args.draft, k=args.k, accept=a, rows=rows,
        inputs=dict(tokens_per_round=args.tokens_per_round, measured_k=args.measured_k,
                    agreement=args.agreement, hit_rates=args.hit_rates)))
    print((args.out / "predictions.md").read_text())
    return 0


def summary(args) -> int:
    """Fold status.txt (one `part rc seconds` line per part) and the test tally into
    summary.json; print one line per part."""
    parts = {}
    status = args.out / "status.txt"
    for line in (status.read_text().splitlines() if status.exists() else []):
        name, rc, secs = line.split()[:3]
        parts[name] = dict(rc=int(rc.split("=")[1]), seconds=float(secs.split("=")[1]))
    tests = args.out / "tests.txt"
    tally = tests.read_text().strip().splitlines()[-1:] if tests.exists() else []
    update_summary(args.out, "parts", parts)
    update_summary(args.out, "tests", tally[0] if tally else None)
    for name, p in parts.items():
        print(f"{name:10s} {'ok' if p['rc'] == 0 else 'FAILED rc=%d' % p['rc']:14s} "
              f"{p['seconds']:.0f} s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["kernels", "exactness", "physics", "predict", "summary"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, kernel interpreted")
    g = ap.add_argument_group("physics")
    g.add_argument("--models", nargs="+", default=list(step_costs.SHAPES),
                   choices=list(step_costs.SHAPES))
    g.add_argument("--tokens", type=int, nargs="+", default=None, help="T scored per step")
    g.add_argument("--rows", type=int, nargs="+", default=None, help="rows of a 1-token step")
    g.add_argument("--context", type=int, default=None, help="cache slots (prefix = half)")
    g.add_argument("--repeats", type=int, default=None)
    g.add_argument("--budget-s", type=float, default=130.0,
                   help="start no further model after this many seconds")
    g = ap.add_argument_group("predict (defaults: CPU-measured on the real pair)")
    g.add_argument("--target", default="qwen2.5-coder-1.5b", choices=list(step_costs.SHAPES))
    g.add_argument("--draft", default="qwen2.5-coder-0.5b", choices=list(step_costs.SHAPES))
    g.add_argument("--k", type=int, default=4, help="lookahead to predict for")
    g.add_argument("--tokens-per-round", type=float, default=3.66)
    g.add_argument("--measured-k", type=int, default=4, help="K of --tokens-per-round")
    g.add_argument("--agreement", type=float, default=0.85, help="per-token greedy agreement")
    g.add_argument("--hit-rates", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    args = ap.parse_args(argv)
    small = args.dry_run
    args.tokens = args.tokens or ([1, 4] if small else [1, 2, 4, 8, 16])
    args.rows = args.rows or ([1, 2] if small else [1, 4, 8, 16])
    args.context = args.context or (64 if small else 2048)
    args.repeats = args.repeats or (2 if small else 20)
    if args.k < 1 or not all(0 <= p <= 1 for p in args.hit_rates):
        ap.error(f"--k {args.k} / --hit-rates {args.hit_rates}: need K >= 1, rates in [0, 1]")
    args.out.mkdir(parents=True, exist_ok=True)
    return {"kernels": kernels, "exactness": exactness, "physics": physics, "predict": predict,
            "summary": summary}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
