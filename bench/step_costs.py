"""What one step of a real-shaped model costs, and what the speed model makes of it.

Random weights of the real shapes (no model files: the GPU machine has no network), bf16:
  decode     one AR step (runner.decode: forward of 1 token, greedy pick, cache commit);
  score T    a forward over T new tokens of one row after its prefix (verification is T=K+1;
             SSD's draft glue is T=K+1, and each tree step scores a row's M branches, ~T=M);
  rows B     a 1-token forward over B rows (batched decoding, a backup over B missed rows).
The prefix is half the cache (--context). Medians of --repeats calls after a warm-up; the
warm-ups (compiles) of one model run in threads, since XLA compiles without the GIL.

`predict` feeds these costs and the acceptance measured on CPU for the real pair into
bench/speed_model.py: AR and SD on one device (draft and target take turns), SSD on two.
"""
from __future__ import annotations

import concurrent.futures
import os
import time

import jax
import jax.numpy as jnp

from bench.speed_model import predict_sd, predict_ssd, tokens_per_round
from bench.timing import median_ms

QWEN2 = dict(arch="qwen2", vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
             max_position_embeddings=32768)
# Published config.json shapes. Tied or untied embeddings cost the same per step.
SHAPES = {
    "qwen2.5-coder-1.5b": dict(QWEN2, hidden_size=1536, intermediate_size=8960, num_layers=28,
                               num_heads=12, num_kv_heads=2, head_dim=128),
    "qwen2.5-coder-0.5b": dict(QWEN2, hidden_size=896, intermediate_size=4864, num_layers=24,
                               num_heads=14, num_kv_heads=2, head_dim=64),
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         rope_theta=100000.0, tie_embeddings=True),
    "llama-3.1-8b": None,  # from ssd_jax/plan/hf_configs.py
}


def model_config(name: str, *, dry_run: bool, attention: str):
    from ssd_jax.config import ModelConfig
    if name not in SHAPES:
        raise ValueError(f"model {name!r} is unknown: use one of {', '.join(SHAPES)}")
    if SHAPES[name] is None:
        from ssd_jax.plan.hf_configs import resolve
        config = resolve(name, dtype="bfloat16")[1]
    else:
        config = ModelConfig(dtype="bfloat16", **SHAPES[name])
    config = config.replace(attention_backend=attention)
    # The dry run keeps each model's head layout (GQA groups, head_dim) and shrinks the rest.
    return config.replace(num_layers=1, hidden_size=128, intermediate_size=256,
                          vocab_size=512) if dry_run else config


def _forward_step(runner, cache, B: int, T: int, prefix: int):
    from ssd_jax.models import causal_mask
    toks = jnp.ones((B, T), jnp.int32)
    pos = jnp.broadcast_to(prefix + jnp.arange(T), (B, T))
    lengths, mask = jnp.full((B,), prefix, jnp.int32), causal_mask(B, T)
    return lambda: jax.block_until_ready(runner.forward(toks, pos, cache, lengths, mask))


def _decode_step(runner, context: int, prefix: int):
    from ssd_jax.core.batch import make_batch
    from ssd_jax.config import SamplingParams
    from ssd_jax.core.rows import RowState
    batch = make_batch([[1]], [SamplingParams(max_new_tokens=10**6)], [[]], 1)
    one = jnp.ones((1,), jnp.int32)
    state = RowState(one, one, jnp.full((1,), prefix, jnp.int32), one, jnp.zeros((1,), bool))
    held = {"cache": runner.new_cache(1, context)}  # donated and replaced by every commit

    def step():
        new_state, held["cache"], _ = runner.decode(state, held["cache"], batch.req)
        jax.block_until_ready((new_state, held["cache"]))
    return step


def measure(name: str, config, *, tokens, rows, context: int, repeats: int, record) -> dict:
    """Times one model's steps; `record(result)` is called after every number (a run cut short
    keeps what it measured)."""
    from flax import nnx
    from ssd_jax.models.transformer import Transformer
    from ssd_jax.core.runner import ModelRunner

    t0 = time.perf_counter()
    runner = ModelRunner(Transformer(config, rngs=nnx.Rngs(0)))
    n_params = sum(x.size for x in jax.tree.leaves(runner.params))
    result = dict(model=name, params=n_params, layers=config.num_layers,
                  attention=config.attention_backend, context=context, decode_ms=None,
                  score_ms={}, rows_ms={}, init_s=time.perf_counter() - t0)
    record(result)
    prefix = context // 2
    shared = runner.new_cache(1, context)  # forward only reads the cache
    steps = {("decode", 1): _decode_step(runner, context, prefix)}
    steps.update({("score", T): _forward_step(runner, shared, 1, T, prefix) for T in tokens})
    steps.update({("rows", B): _forward_step(runner, runner.new_cache(B, context), B, 1, prefix)
                  for B in rows if B != 1 or 1 not in tokens})  # rows 1 = score 1
    t0 = time.perf_counter()
    workers = min(8, len(steps), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(step) for step in steps.values()]:
            f.result()
    result["compile_s"] = time.perf_counter() - t0
    for (kind, n), step in steps.items():
        ms = median_ms(step, repeats, warmup=1)
        if kind == "decode":
            result["decode_ms"] = ms
        else:
            result[f"{kind}_ms"][n] = ms
        if kind == "score" and n == 1 and 1 in rows:
            result["rows_ms"][1] = ms
        record(result)
    return result


def physics_markdown(results: list[dict], header: str) -> str:
    tokens = sorted({T for r in results for T in r["score_ms"]})
    rows = sorted({B for r in results for B in r["rows_ms"]})
    cols = (["model", "params", "attention", "decode step ms"] + [f"T={T}" for T in tokens]
            + [f"rows {B}" for B in rows])
    lines = [header, "", "Cells: ms (ratio to scoring 1 token).", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        one = r["score_ms"].get(1)
        cell = lambda ms: "–" if ms is None else (f"{ms:.3f}" + (f" ({ms / one:.2f}x)" if one
                                                                   else ""))
        lines.append("| " + " | ".join(
            [r["model"], f"{r['params'] / 1e6:.0f}M", r["attention"],
             "–" if r["decode_ms"] is None else f"{r['decode_ms']:.3f}"]
            + [cell(r["score_ms"].get(T)) for T in tokens]
            + [cell(r["rows_ms"].get(B)) for B in rows]) + " |")
        if r.get("error"):
            lines.append(f"|  | error: {r['error']} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ predictions
def interpolate(points: dict, x: float) -> float:
    """Linear in the number of tokens between measured points (extrapolated past the ends).

    Scoring more tokens never costs less, so a point above a later one is timing noise and is
    lowered to it first: a CI dry run once timed T=1 at 2.4 ms and T=4 at 0.4 ms, and the line
    through them put scoring 5 tokens below zero."""
    xs = sorted(int(k) for k in points)
    points = {x_: min(points[v] for v in xs if v >= x_) for x_ in xs}
    if len(xs) == 1:
        return points[xs[0]]
    lo = max([v for v in xs[:-1] if v <= x] or [xs[0]])
    hi = xs[xs.index(lo) + 1]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def geometric_hist(a: float, k: int) -> list[float]:
    """Accept-length distribution when each draft token is accepted with probability a."""
    return [a**j * (1 - a) for j in range(k)] + [a**k]


def acceptance_from_tokens(e: float, k: int) -> float:
    """The per-token acceptance a whose geometric model emits e tokens per round at lookahead
    k (bisection on E(a) = (1 - a^(k+1)) / (1 - a), increasing in a)."""
    if not 1.0 <= e <= k + 1:
        raise ValueError(f"tokens per round {e} is impossible at K={k}: it lies in [1, K+1]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(geometric_hist(mid, k)) < e else (lo, mid)
    return (lo + hi) / 2


def predict(target: dict, draft: dict, *, k: int, accept: float, hit_rates) -> list[dict]:
    """AR / SD on one device, SSD on two (draft on its own), batch 1, greedy. Costs in ms.

    SD round: verify (score K+1) + K draft steps, one after the other on the one device.
    SSD: verify on the target device while the draft builds the tree there: glue (one token:
    r..s_{K-1} were fed when the speculation was decoded, ssd_jax/core/glue.py) + K tree steps
    of M = 2(K+1) branches (score M); a miss adds the neural backup (K draft steps). At T=0 a hit's speculation and the backup's are both the draft's greedy
    continuation of the verified prefix, so E_hit = E_miss = SD's tokens per round."""
    hist = geometric_hist(accept, k)
    sec = lambda ms: ms / 1e3
    t_ar = sec(target["decode_ms"])
    t_verify = sec(interpolate(target["score_ms"], k + 1))
    t_draft = sec(draft["decode_ms"]) * k
    t_build = sec(draft["decode_ms"] + k * interpolate(draft["score_ms"], 2 * (k + 1)))
    ar = 1.0 / t_ar
    out = [dict(mode="AR", devices=1, hit_rate=None, tok_s=ar, vs_ar=1.0, step_ms=1e3 * t_ar)]
    sd = predict_sd(hist=hist, rows=1, t_verify=t_verify, t_draft=t_draft, ar_tok_s=ar)
    out.append(dict(mode="SD", devices=1, hit_rate=None, tok_s=sd["tok_s"],
                    vs_ar=sd["speedup_vs_ar"], tokens_per_round=sd["e"],
                    verify_ms=1e3 * t_verify, draft_ms=1e3 * t_draft))
    for p in hit_rates:
        ssd = predict_ssd(hist_hit=[p * h for h in hist], hist_miss=[(1 - p) * h for h in hist],
                          all_hit_rate=p, rows=1, t_verify=t_verify, t_build=t_build,
                          t_backup=t_draft, ar_tok_s=ar)
        out.append(dict(mode="SSD", devices=2, hit_rate=p, tok_s=ssd["tok_s"],
                        vs_ar=ssd["speedup_vs_ar"], tokens_per_round=tokens_per_round(hist),
                        verify_ms=1e3 * t_verify, build_ms=1e3 * t_build,
                        backup_ms=1e3 * t_draft))
    return out


def predictions_markdown(rows: list[dict], header: str) -> str:
    f = lambda v, fmt: "–" if v is None else fmt.format(v)
    lines = [header, "", "| mode | devices | hit rate | tokens/round | tok/s | vs AR | "
             "verify ms | draft / tree-build ms |", "|" + "---|" * 8]
    for r in rows:
        lines.append("| " + " | ".join([
            r["mode"], str(r["devices"]), f(r["hit_rate"], "{:.2f}"),
            f(r.get("tokens_per_round"), "{:.2f}"), f(r["tok_s"], "{:.1f}"),
            f(r["vs_ar"], "{:.2f}x"), f(r.get("verify_ms", r.get("step_ms")), "{:.3f}"),
            f(r.get("draft_ms", r.get("build_ms")), "{:.3f}")]) + " |")
    return "\n".join(lines) + "\n"
