"""The SSD speed model (paper, Theorem 7) evaluated on measured quantities.

    speedup_SSD = [p E_hit + (1 - p) E_miss] / [p max(1, T_p) + (1 - p)(1 + T_b)]
    speedup_SD  = E / (1 + T_draft)

p: cache hit rate, E_hit / E_miss: mean tokens a row emits per round after a hit / a miss,
T_p: draft tree-build time, T_b: backup time, T_draft: SD's K draft steps, all in units of one
verification. Both are speedups over a decoder that emits one token per verification-time.
With a batch, a miss in any row delays the whole round, so the denominator uses the all-hit
rate p_B (= p at batch 1) and the numerator the per-row p.

Measured wall-clock: the theorem's unit is one *verification*, but on a CPU verifying K+1
tokens costs ~2x an AR step (platform notes), so we also turn the model into a tok/s prediction
(seconds per round = t_verify * denominator) and divide by the *measured* AR tok/s. The model
assumes draft and target run concurrently on separate hardware: a single-process CPU run, where
they share the cores, is expected to fall short of it.
"""
from __future__ import annotations


def tokens_per_round(hist) -> float | None:
    """Mean tokens emitted per round ((k accepted) + 1) from an accept-length histogram."""
    rounds = sum(hist)
    return sum((k + 1) * c for k, c in enumerate(hist)) / rounds if rounds else None


def predict_ssd(*, hist_hit, hist_miss, all_hit_rate: float, rows: float, t_verify: float,
                t_build: float, t_backup: float, ar_tok_s: float | None = None) -> dict | None:
    hits, misses = sum(hist_hit), sum(hist_miss)
    if not hits + misses or t_verify <= 0:
        return None
    p = hits / (hits + misses)
    e_hit, e_miss = tokens_per_round(hist_hit) or 0.0, tokens_per_round(hist_miss) or 0.0
    tp, tb = t_build / t_verify, t_backup / t_verify
    num = p * e_hit + (1 - p) * e_miss
    den = all_hit_rate * max(1.0, tp) + (1 - all_hit_rate) * (1 + tb)
    tok_s = rows * num / (t_verify * den)
    return dict(p=p, p_all=all_hit_rate, e_hit=e_hit, e_miss=e_miss, t_p=tp, t_b=tb,
                t_verify_ms=1e3 * t_verify, thm7_speedup=num / den, tok_s=tok_s,
                speedup_vs_ar=tok_s / ar_tok_s if ar_tok_s else None)


def predict_sd(*, hist, rows: float, t_verify: float, t_draft: float,
               ar_tok_s: float | None = None) -> dict | None:
    e = tokens_per_round(hist)
    if e is None or t_verify <= 0:
        return None
    td = t_draft / t_verify
    tok_s = rows * e / (t_verify + t_draft)
    return dict(e=e, t_draft=td, t_verify_ms=1e3 * t_verify, thm_speedup=e / (1 + td),
                tok_s=tok_s, speedup_vs_ar=tok_s / ar_tok_s if ar_tok_s else None)
