"""Exactness on the device: greedy AR == SD == SSD, and the Pallas model == the XLA model.

A tiny random Qwen2-style pair is built in place (no model files): weights widened so greedy
decisions are crisp, the draft = the target plus noise, so SD rejects and SSD's speculation
cache both hits and misses (equal outputs then mean something).
"""
from __future__ import annotations

import time

PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8, [3, 1, 4, 1, 5, 9, 2, 6]]
MODES = ("ar", "sd", "ssd")
TOL = 3e-2  # bf16 logits: |pallas - xla| <= TOL * max(1, max |logit|)


def first_diff(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per row, the first step where two greedy outputs differ (None: equal)."""
    return [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), None) for r, s in zip(a, b)]


def tiny_config(dtype: str, dry_run: bool):
    from ssd_jax.config import ModelConfig
    # head_dim 64: the Triton lowering needs a power of two >= 16; 2 query heads per KV head.
    # The dry run has one layer: CPU compiles are nearly all of its time.
    return ModelConfig(arch="qwen2", vocab_size=256, hidden_size=256, intermediate_size=512,
                       num_layers=1 if dry_run else 2, num_heads=4, num_kv_heads=2,
                       head_dim=64, dtype=dtype, rope_theta=1e6, max_position_embeddings=1024)


def random_model(config, seed: int, base=None, noise: float = 0.0):
    """A random model with crisp logits: the 0.02 init gives near-uniform logits, whose near-ties
    any rounding difference flips. Weights ~N(0, 0.08), biases ~N(0, 0.5) (as the HF test
    fixtures). With `base`: its weights plus N(0, noise) on every matrix (a noisy draft)."""
    import jax
    from flax import nnx
    from ssd_jax.models.transformer import Transformer
    model = Transformer(config, rngs=nnx.Rngs(seed))
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        nnx.state(model if base is None else base, nnx.Param))
    keys = jax.random.split(jax.random.key(seed), len(flat))

    def draw(key, path, x):
        normal = jax.random.normal(key, x.shape, x.dtype)
        if base is not None:
            return x + noise * normal if x.ndim > 1 else x
        if x.ndim > 1:
            return 0.08 * normal
        return 0.5 * normal if "bias" in str(path[-2]) else x  # norms keep their ones
    nnx.update(model, jax.tree_util.tree_unflatten(
        treedef, [draw(k, p, x) for k, (p, x) in zip(keys, flat)]))
    return model


def speculation(dry_run: bool, n_new: int) -> list[dict]:
    """Greedy AR, SD and SSD on one device (single-controller driver) for batch 1 and 4 (the
    dry run: 4 only; batch 1 is the same code at another shape, and compiles are its cost)."""
    import jax
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    config = tiny_config("float32", dry_run)
    target = random_model(config, 0)
    draft = random_model(config, 1, base=target, noise=0.005)
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16,
                                  driver="single"))
    p = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    attention = "jnp" if jax.default_backend() == "cpu" else "pallas"  # what "auto" picks
    rows = []
    for batch in (4,) if dry_run else (1, 4):
        t0 = time.perf_counter()
        outs = {m: llm.generate(PROMPTS[:batch], p, mode=m) for m in MODES}
        tokens = {m: [o.token_ids for o in outs[m]] for m in MODES}
        ssd = outs["ssd"][0].metrics.ssd
        rows.append(dict(batch=batch, attention=attention,
                         sd_equals_ar=tokens["sd"] == tokens["ar"],
                         ssd_equals_ar=tokens["ssd"] == tokens["ar"],
                         sd_acceptance=outs["sd"][0].metrics.acceptance,
                         ssd_hits=ssd.hits, ssd_rounds=ssd.rounds,
                         tokens=sum(map(len, tokens["ar"])), seconds=time.perf_counter() - t0,
                         sd_first_diff=first_diff(tokens["ar"], tokens["sd"]),
                         ssd_first_diff=first_diff(tokens["ar"], tokens["ssd"]), **tokens))
    return rows


def backends(dry_run: bool, n_new: int) -> dict:
    """The same bf16 weights with the Pallas kernel and with the jnp/XLA attention: logits of a
    decode step, an SD-style chain and an SSD-style tree after a filled prefix (rows at
    different lengths), then greedy AR over PROMPTS."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from bench.kernels import tree_mask
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.models import causal_mask
    from ssd_jax.models.transformer import Transformer
    from ssd_jax.core.runner import ModelRunner
    config = tiny_config("bfloat16", dry_run)
    xla = random_model(config.replace(attention_backend="jnp"), 2)
    # The dry run has no Pallas lowering (CPU): the kernel's GPU program runs interpreted.
    kernel = "pallas-interpret" if dry_run else "pallas"
    pallas = Transformer(config.replace(attention_backend=kernel), rngs=nnx.Rngs(2))
    nnx.update(pallas, nnx.state(xla, nnx.Param))
    runners = {"xla": ModelRunner(xla), "pallas": ModelRunner(pallas)}
    rng = np.random.default_rng(0)
    B, prefix = 2, np.array([37, 100])
    cache = runners["xla"].fill(jnp.asarray(rng.integers(0, config.vocab_size, (B, 128)),
                                            jnp.int32), runners["xla"].new_cache(B, 256))
    masks = {"decode": causal_mask(B, 1), "chain": causal_mask(B, 5),
             "tree": jnp.asarray(np.stack([tree_mask(rng, 8) for _ in range(B)]))}
    if dry_run:  # two CPU compiles per case; the tree case runs the chain's code too
        del masks["chain"]
    cases = {}
    for name, mask in masks.items():
        T = mask.shape[1]
        toks = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)
        pos = jnp.asarray(prefix[:, None] + np.arange(T), jnp.int32)
        got = {k: np.asarray(r.forward(toks, pos, cache, jnp.asarray(prefix, jnp.int32),
                                       mask)[0]) for k, r in runners.items()}
        ref = got["xla"]
        same = got["pallas"].argmax(-1) == ref.argmax(-1)
        top2 = np.sort(ref, axis=-1)[..., -2:]
        diff = float(np.abs(got["pallas"] - ref).max())
        cases[name] = dict(max_abs_diff=diff, max_abs_logit=float(np.abs(ref).max()),
                           within_tol=diff <= TOL * max(1.0, float(np.abs(ref).max())),
                           argmax_agree=int(same.sum()), positions=int(same.size),
                           # a disagreement at a near-tie is rounding, not a kernel error
                           min_margin_where_not=float((top2[..., 1] - top2[..., 0])[~same].min())
                           if (~same).any() else None)
    p = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    engine = EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16)
    greedy = {k: [o.token_ids for o in LLM(m, engine=engine).generate(PROMPTS, p, mode="ar")]
              for k, m in (("xla", xla), ("pallas", pallas))}
    diffs = first_diff(greedy["xla"], greedy["pallas"])
    gaps = [None if i is None else
            _gap(runners["xla"], prompt + greedy["xla"][r][:i], greedy["xla"][r][i],
                 greedy["pallas"][r][i]) for r, (prompt, i) in enumerate(zip(PROMPTS, diffs))]
    return dict(cases=cases, greedy_equal=greedy["xla"] == greedy["pallas"],
                greedy_tokens=sum(map(len, greedy["xla"])), greedy_first_diff=diffs,
                # bf16 logits are rounded to 2^-8 relative: ties are common, and a tie may go
                # either way. A divergence is a kernel error only if it is not one.
                greedy_near_ties=all(g is None or g["within_tol"] for g in gaps),
                greedy_gaps=gaps)


def _gap(runner, ids: list[int], a: int, b: int) -> dict:
    """How far apart the reference's logits of tokens a and b are after `ids` (a full
    forward of the sequence, no cache)."""
    import jax.numpy as jnp
    import numpy as np
    from ssd_jax.models import causal_mask
    T = len(ids)
    logits, _ = runner.forward(jnp.asarray([ids], jnp.int32), jnp.arange(T)[None],
                               runner.new_cache(1, T), jnp.zeros((1,), jnp.int32),
                               causal_mask(1, T))
    last = np.asarray(logits[0, -1])
    gap = float(last[a] - last[b])
    return dict(gap=gap, within_tol=abs(gap) <= TOL * max(1.0, float(np.abs(last).max())))


def passed(spec: list[dict], agree: dict | None) -> bool:
    return (all(r["sd_equals_ar"] and r["ssd_equals_ar"] for r in spec) and agree is not None
            and agree["greedy_near_ties"] and all(c["within_tol"] for c in agree["cases"].values()))


def markdown(spec: list[dict], agree: dict | None, header: str) -> str:
    yes = lambda b: "**equal**" if b else "**DIFFERENT**"
    lines = [header, "", "Greedy AR vs SD vs SSD, tiny random fp32 Qwen2-style pair (draft = "
             "target + noise), K=3, M=8, one device, single-controller driver, attention: "
             f"{spec[0]['attention'] if spec else '?'}.", "",
             "| batch | SD vs AR | SSD vs AR | tokens | SD acceptance | SSD hits / rounds | s |",
             "|---|---|---|---|---|---|---|"]
    for r in spec:
        lines.append(f"| {r['batch']} | {yes(r['sd_equals_ar'])} | {yes(r['ssd_equals_ar'])} | "
                     f"{r['tokens']} | {r['sd_acceptance']:.2f} | {r['ssd_hits']} / "
                     f"{r['ssd_rounds']} | {r['seconds']:.1f} |")
    lines += [f"\nbatch {r['batch']}: first differing step per row, SD {r['sd_first_diff']}, "
              f"SSD {r['ssd_first_diff']}" for r in spec
              if not (r["sd_equals_ar"] and r["ssd_equals_ar"])]
    if agree is None:
        return "\n".join(lines) + "\n"
    lines += ["", f"Pallas-kernel model vs XLA-attention model, same bf16 weights (logits within "
              f"{TOL} x max abs logit; greedy AR over {len(PROMPTS)} prompts).", "",
              "| input | max abs diff | max abs logit | within tol | argmax agree | "
              "min top-2 margin where not |", "|---|---|---|---|---|---|"]
    for name, c in agree["cases"].items():
        margin = c["min_margin_where_not"]
        lines.append(f"| {name} | {c['max_abs_diff']:.4f} | {c['max_abs_logit']:.2f} | "
                     f"{'yes' if c['within_tol'] else '**NO**'} | {c['argmax_agree']}/"
                     f"{c['positions']} | {'–' if margin is None else f'{margin:.4f}'} |")
    verdict = ("**equal**" if agree["greedy_equal"] else "**equal up to near-ties**"
               if agree["greedy_near_ties"] else "**DIFFERENT**")
    lines += ["", f"Greedy tokens ({agree['greedy_tokens']}): {verdict}" + (
        "" if agree["greedy_equal"] else f" (first differing step per prompt: "
        f"{agree['greedy_first_diff']}; reference logit gap there: "
        f"{[g and round(g['gap'], 4) for g in agree['greedy_gaps']]})")]
    return "\n".join(lines) + "\n"
