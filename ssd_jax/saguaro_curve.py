"""Saguaro's C for the speed model: how acceptance and the cache hit rate move with C, from the
pair's own next-token distributions.

At temperature > 0 a rejected position's recovery token is drawn from norm(max(0, p - q')),
where the draft put little mass, so the cache's top-F forks tend to miss. Saguaro draws the
speculation from q' = q with its top-F probabilities scaled by C, renormalised: the residual
moves onto the forked tokens (more hits) at some cost in acceptance. Both effects depend on p
and q, so they are measured on them: the target samples a continuation of CALIBRATION_PROMPT
at the run's temperature, top-k and top-p (the tokens a run at these settings would make), then
the target and the draft each score it (teacher-forced), and per position n of the
continuation, C and F (the fork count at a depth):

  alpha(C, F)  = sum_x min(p, q')                         acceptance of one speculated token
  rec(C, F)    = sum_{x in top-F(q)} max(0, p - q') / sum_n (1 - alpha)
                                                          a rejection's recovery is forked
  bonus(F)     = sum_{x in top-F(q)} p                    after full acceptance, the bonus is

(averaged over positions; rec weighted by each position's rejection mass). A rejected s never
has p(s) > q'(s), so the recovery is never the speculated token itself, which the forks skip.
The engine's learnt acceptance a (from real runs, at C = 1) is scaled by alpha(C)/alpha(1),
and the per-round hit rate is sum_{k<K} P(k) rec(C, F_k) + P(K) bonus(F_K) (autotune.predict).
One prompt's continuation stands in for the run's own tokens (said so in the README). A first
version scored a fixed text instead; on the Qwen pair at T = 0.7 it over-valued low C (chose
C = 0.2, which a measured sweep put 5% below C = 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssd_jax.core.fanout import geometric_probs

C_CANDIDATES = (1.0, 0.8, 0.6, 0.4, 0.2)
F_MAX = 16  # fork counts above this are treated as F_MAX (their marginal effect is small)
POSITIONS = 64  # tokens of the target's continuation, scored by each model
CALIBRATION_PROMPT = ("Write a Python function that merges two sorted lists into one sorted "
                      "list, then explain in two sentences why it runs in linear time.")


def sample_continuation(runner, ids: list[int], temperature: float, top_k: int, top_p: float,
                        n: int = POSITIONS, sharding=None, min_p: float = 0.0) -> list[int]:
    """`n` tokens the target samples after `ids` at these settings (seed 0)."""
    from ssd_jax.config import SamplingParams
    from ssd_jax.core.batch import make_batch, round_up
    from ssd_jax.core.metrics import RunMetrics
    from ssd_jax.core.rounds import TargetSide, ar_loop
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            max_new_tokens=n, seed=0, ignore_eos=True)
    batch = make_batch([ids], [params], [[]], 64)
    side = TargetSide(runner, batch.place(sharding),
                      runner.new_cache(batch.size, round_up(len(ids) + n + 2, 256)))
    out: list[int] = []
    for chunk in ar_loop(side, RunMetrics("ar", 1), 8):
        out += chunk[0]
    return out[:n]


def target_calibration(runner, prompt: list[int], temperature: float, top_k: int,
                       top_p: float, n: int = POSITIONS, sharding=None, min_p: float = 0.0
                       ) -> tuple[list[int], np.ndarray]:
    """The target's side of a calibration: `n` tokens it samples after `prompt`, and its
    probabilities for them ([n, V]). The draft then scores prompt + those tokens
    (teacher_forced_probs with its vocab map and last=n)."""
    more = sample_continuation(runner, prompt, temperature, top_k, top_p, n, sharding, min_p)
    return more, teacher_forced_probs(runner, prompt + more, temperature, top_k, top_p,
                                      last=len(more), min_p=min_p)


def teacher_forced_probs(runner, tokens: list[int], temperature: float, top_k: int,
                         top_p: float, vocab=None, last: int | None = None,
                         min_p: float = 0.0) -> np.ndarray:
    """[N, V_target] next-token probabilities of `runner`'s model at each position of
    `tokens`, processed as a run at these settings processes them (`last`: only the last N
    positions' predictions, those of a continuation's tokens). `vocab`: the draft's map (its
    proposals are drawn over its own columns, then named in target ids)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from ssd_jax.models.attention import causal_mask
    from ssd_jax.sampling import process_probs
    from ssd_jax.sharding import put
    n = len(tokens)
    on = None if runner.mesh is None else NamedSharding(runner.mesh, P())
    cache = runner.new_cache(1, n + 1)
    ids = np.asarray([tokens], np.int32)
    args = put((ids if vocab is None else np.asarray(vocab.draft_ids(jnp.asarray(ids))),
                np.arange(n, dtype=np.int32)[None], np.zeros((1,), np.int32),
                np.asarray(causal_mask(1, n))), on)
    logits = runner.forward(args[0], args[1], cache, args[2], args[3])[0]
    if vocab is not None:
        logits = vocab.proposable(logits)
    probs = process_probs(logits, jnp.full((1,), temperature), jnp.full((1,), top_k, jnp.int32),
                          jnp.full((1,), top_p), jnp.full((1,), min_p))
    if vocab is not None:
        probs = vocab.target_probs(probs)
    return np.asarray(probs[0] if last is None else probs[0, n - 1 - last:n - 1], np.float32)


@dataclass(frozen=True)
class SaguaroCurve:
    """alpha[c][F], rec[c][F] (F = 0..F_MAX) for each C in `cs`, bonus[F]; `hit_scale`: what
    sampled runs hit over what the curve promised them (learnt by the engine, pooled over the
    runs like the acceptance; 1 until a run teaches it). One calibration prompt stands in for
    a whole suite's tokens: on code at T = 0.7 the curve promised 0.85 where the runs hit 0.70."""

    cs: tuple
    alpha: tuple
    rec: tuple
    bonus: tuple
    hit_scale: float = 1.0

    @classmethod
    def fit(cls, p: np.ndarray, q: np.ndarray, cs=C_CANDIDATES, f_max: int = F_MAX
            ) -> "SaguaroCurve":
        """From target probabilities p and draft probabilities q, both [N, V] over the target
        vocabulary at the same N positions."""
        p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
        f_max = min(f_max, q.shape[1])
        # Top-F of q in the fork's order (probability desc, index asc).
        order = np.lexsort((np.broadcast_to(np.arange(q.shape[1]), q.shape), -q))[:, :f_max]
        qs, ps = np.take_along_axis(q, order, 1), np.take_along_axis(p, order, 1)
        cum_q = np.concatenate([np.zeros((len(q), 1)), np.cumsum(qs, 1)], 1)  # [N, F+1]
        alpha, rec = [], []
        for c in cs:
            a_row, r_row = [], []
            for f in range(f_max + 1):
                z = 1.0 - (1.0 - c) * cum_q[:, f]  # [N] the renormaliser of q'
                head = np.minimum(ps[:, :f], c * qs[:, :f] / z[:, None]).sum(1)
                whole = np.minimum(p, q / z[:, None]).sum(1)
                tail = whole - np.minimum(ps[:, :f], qs[:, :f] / z[:, None]).sum(1)
                acc = head + tail  # [N] sum_x min(p, q')
                forked = np.maximum(ps[:, :f] - c * qs[:, :f] / z[:, None], 0).sum(1)
                reject = np.clip(1.0 - acc, 0.0, None)
                a_row.append(float(acc.mean()))
                r_row.append(float(forked.sum() / reject.sum()) if reject.sum() > 1e-12 else 1.0)
            alpha.append(tuple(a_row))
            rec.append(tuple(r_row))
        bonus = tuple(float(x) for x in np.concatenate([[0.0], np.cumsum(ps, 1).mean(0)]))
        return cls(tuple(float(c) for c in cs), tuple(alpha), tuple(rec), bonus)

    def _f(self, f) -> int:
        return int(min(max(int(f), 0), len(self.bonus) - 1))

    def _at(self, table, c: float, f) -> float:
        """table[C][F], linear in C between the measured constants (clamped outside them)."""
        order = np.argsort(self.cs)
        cs = np.asarray(self.cs)[order]
        return float(np.interp(c, cs, [table[i][self._f(f)] for i in order]))

    def acceptance(self, a: float, c: float, fan) -> float:
        """The learnt acceptance a (at C = 1, where no F rescales anything) at C with this
        fan-out (mean over its depths)."""
        ratio = (np.mean([self._at(self.alpha, c, f) for f in fan[:-1]])
                 / max(self._at(self.alpha, 1.0, 0), 1e-9))
        return float(np.clip(a * ratio, 0.0, 0.999))

    def hit_rate(self, c: float, fan, a: float, learnt: bool = True) -> float:
        """Per-round hit rate with fan-out F_0..F_K at acceptance a (times hit_scale unless
        not `learnt`: the calibration's own figure)."""
        k = len(fan) - 1
        probs = geometric_probs(a, k)
        hits = [self._at(self.rec, c, f) for f in fan[:-1]] + [self.bonus[self._f(fan[-1])]]
        raw = float((probs * np.asarray(hits)).sum())
        return min(1.0, raw * self.hit_scale) if learnt else raw

    def to_dict(self) -> dict:
        """The measured curve (the learnt hit_scale is pooled beside it by TuneStore)."""
        return dict(cs=list(self.cs), alpha=[list(r) for r in self.alpha],
                    rec=[list(r) for r in self.rec], bonus=list(self.bonus))

    @classmethod
    def from_dict(cls, d: dict) -> "SaguaroCurve":
        return cls(tuple(d["cs"]), tuple(tuple(r) for r in d["alpha"]),
                   tuple(tuple(r) for r in d["rec"]), tuple(d["bonus"]),
                   float(d.get("hit_scale", 1.0)))
