"""How good and how cheap is the draft? Acceptance on held-out prompts, decode latency on CPU.

Acceptance (greedy): the target answers each held-out chat prompt greedily with our AR engine;
the draft then reads prompt + answer teacher-forced, and position t matches when the draft's
argmax equals the target's next token. Greedy SD accepts a draft token exactly when it equals
the target's greedy token after the same prefix, and an accepted token is the target's own, so
the run of matches starting at a position is exactly what an SD round starting there accepts
(capped at K). We report
  a                per-token acceptance (fraction of matching positions),
  mean_accepted    mean over positions of min(K, run of matches from there),
  sd_accepted      accepted tokens per round of a simulated greedy SD pass over each answer
                   (rounds start after the previous round's accepted tokens + correction),
  rank_coverage    how often the target's token is within the draft's top-n: the ceiling on
                   SSD cache hits after a rejection with n-1 branches forked there.
Latency: one jitted decode step (forward of 1 token over a cache of `cache_len` with `prefix`
committed slots, then the donated commit), batch 1, warmed up, median of `reps`, same devices.
"""
from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.config import EngineConfig, SamplingParams
from ssd_jax.distill.prompts import held_out_prompts
from ssd_jax.draft_vocab import DraftModel
from ssd_jax.models.attention import causal_mask
from ssd_jax.core.runner import ModelRunner, forward


def match_stats(matches: list[np.ndarray], K: int) -> dict:
    """Acceptance numbers from per-answer boolean match arrays (see module docstring)."""
    runs, rounds, accepted = [], 0, 0
    for m in matches:
        run = np.zeros(len(m) + 1, np.int64)
        for t in range(len(m) - 1, -1, -1):  # run[t] = consecutive matches starting at t
            run[t] = run[t + 1] + 1 if m[t] else 0
        runs.append(np.minimum(run[:-1], K))
        t = 0
        while t < len(m):
            acc = int(min(K, run[t], len(m) - t))
            rounds, accepted, t = rounds + 1, accepted + acc, t + acc + 1
    allm = np.concatenate(matches)
    return {"a": float(allm.mean()), "positions": int(allm.size), "K": K,
            "mean_accepted": float(np.concatenate(runs).mean()),
            "sd_accepted": accepted / max(rounds, 1),
            "sd_tokens_per_round": (accepted + rounds) / max(rounds, 1)}


def target_ranks(draft: DraftModel, prompts_ids, answers) -> list[np.ndarray]:
    """Per answer: the rank (1 = the draft's argmax) of the target's greedy token among the
    draft's logits at each answer position. Rank 1 is a greedy match; an SSD cache hit after
    a rejection at that position needs ranks 2..F+1 (F branches forked there)."""
    runner = ModelRunner(draft)
    out = []
    for p, ans in zip(prompts_ids, answers):
        seq = np.asarray(p + ans, np.int32)
        T = int(-(-len(seq) // 64) * 64)  # bucket, so few programs compile
        x = np.zeros((1, T), np.int32)
        x[0, :len(seq)] = seq
        logits, _ = forward(runner.graphdef, runner.leaves, jnp.asarray(x),
                            jnp.arange(T)[None], runner.new_cache(1, 1),
                            jnp.zeros((1,), jnp.int32), causal_mask(1, T))
        # position len(p)-1+j predicts answer token j
        lg = np.asarray(logits[0, len(p) - 1:len(seq) - 1])
        want = lg[np.arange(len(ans)), np.asarray(ans)]
        # ties count against the target token, as argmax (lowest id) would break them
        ahead = (lg > want[:, None]).sum(1) + ((lg == want[:, None])
                                              & (np.arange(lg.shape[1]) < np.asarray(ans)[:, None])).sum(1)
        out.append(ahead + 1)
    return out


def rank_coverage(ranks: list[np.ndarray], cutoffs=(1, 2, 3, 4, 6, 8, 10, 16, 32)) -> dict:
    """Fraction of positions whose target token is within the draft's top-n, per n."""
    allr = np.concatenate(ranks)
    return {f"top{n}": float((allr <= n).mean()) for n in cutoffs}


def decode_latency(model, *, cache_len: int = 512, prefix: int = 256, reps: int = 100) -> float:
    """Median seconds of one batch-1 decode step (forward + commit), after warm-up."""
    runner = ModelRunner(model)
    cache = runner.new_cache(1, cache_len)
    tok = jnp.zeros((1, 1), jnp.int32)
    pos = jnp.full((1, 1), prefix, jnp.int32)
    plen = jnp.full((1,), prefix, jnp.int32)
    mask = jnp.ones((1, 1, 1), bool)
    from ssd_jax.models.transformer import commit
    times = []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        logits, new = forward(runner.graphdef, runner.leaves, tok, pos, cache, plen, mask)
        tok = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
        cache = commit(cache, new, plen)
        jax.block_until_ready((tok, cache))
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _load_draft(name: str):
    """Our distilled drafts speak target ids through their vocabulary map; a pretrained draft
    that shares the target's tokenizer (Qwen2.5-Coder-0.5B) is used as it is."""
    from ssd_jax.draft_vocab import VocabMap
    from ssd_jax.loading import load
    model, _, extra = load(name)
    return DraftModel(model, VocabMap.from_dict(extra["vocab_map"])) if extra.get("vocab_map") \
        else model


def measure(draft_name: str = "smollm2-draft", *, target_name: str = "smollm2",
            max_new_tokens: int = 128, K: int = 5) -> dict:
    from ssd_jax import LLM

    prompts = held_out_prompts()
    llm = LLM(target_name, engine=EngineConfig(max_batch=32, max_seq_len=512, prefill_bucket=128))
    draft = _load_draft(draft_name)
    ids = [llm.prompts.encode(p, chat=True) for p in prompts]
    t0 = time.perf_counter()
    res = llm.generate(ids, SamplingParams(max_new_tokens=max_new_tokens), chat=False)
    gen_s = time.perf_counter() - t0
    answers = [r.token_ids for r in res]
    n_instr = sum(1 for p in prompts if "```python" not in p)
    ranks = target_ranks(draft, ids, answers)
    matches = [r == 1 for r in ranks]
    report = {"all": match_stats(matches, K),
              "instructions": match_stats(matches[:n_instr], K),
              "code": match_stats(matches[n_instr:], K)}
    report["rank_coverage"] = rank_coverage(ranks)
    t_target = decode_latency(llm.model)
    t_draft = decode_latency(draft)
    report["latency"] = {"target_ms": 1e3 * t_target, "draft_ms": 1e3 * t_draft,
                         "ratio": t_draft / t_target, "batch": 1, "cache_len": 512, "prefix": 256,
                         "devices": str(jax.devices())}
    report["prompts"] = len(prompts)
    report["target_generate_s"] = gen_s
    s = report["all"]
    print(json.dumps(report, indent=1))
    print(f"\ngreedy acceptance a = {s['a']:.3f} over {s['positions']} positions "
          f"(instructions {report['instructions']['a']:.3f}, code {report['code']['a']:.3f}); "
          f"mean accepted length at K={K}: {s['mean_accepted']:.2f} "
          f"(simulated SD: {s['sd_accepted']:.2f} accepted, {s['sd_tokens_per_round']:.2f} "
          f"tokens/round)\ntarget token within the draft's top 2 / 6 / 10 / 32: "
          f"{report['rank_coverage']['top2']:.3f} / {report['rank_coverage']['top6']:.3f} / "
          f"{report['rank_coverage']['top10']:.3f} / {report['rank_coverage']['top32']:.3f}"
          f"\ndecode latency, batch 1, cache 512: target "
          f"{1e3 * t_target:.2f} ms, draft {1e3 * t_draft:.2f} ms "
          f"({100 * t_draft / t_target:.1f}% of target) on {jax.devices()}")
    return report
