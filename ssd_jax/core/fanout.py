"""Fan-out: how the branch budget M of a row is split over the K+1 possible accept lengths.

The speculation cache pre-speculates F_j recovery/bonus tokens at glue position j (the outcome
"j draft tokens accepted"), with sum_j F_j = M fixed so shapes stay static. SSD's Theorem:
with misses at a position following a power law 1 - p_hit(F) ~ F^-r and accept lengths
P(k), the hit probability sum_k P(k) (1 - F_k^-r) under sum F_k = M is maximised by
F_k proportional to P(k)^(1/(1+r)).
  uniform:    F_k = M / (K+1).
  geometric:  P(k) capped-geometric in the per-token acceptance a: (1-a) a^k for k < K, a^K.
  empirical:  P(k) = the measured accept-length histogram (smoothed).
Rows whose current speculation came from the fast backup (acceptance near 0) use a separate
list that puts nearly everything on j = 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

EPS = 1e-3


def allocate(weights: np.ndarray, budget: int) -> np.ndarray:
    """Integers proportional to `weights` summing to `budget` (largest remainder), with at
    least one branch for every outcome of non-negligible weight while the budget allows."""
    w = np.maximum(np.asarray(weights, np.float64), 0)
    w = w / w.sum() if w.sum() > 0 else np.full_like(w, 1 / len(w))
    f = np.zeros(len(w), np.int64)
    must = np.argsort(-w)[:budget]
    must = must[w[must] > EPS]
    f[must] = 1
    rest = budget - f.sum()
    raw = w * rest
    f += np.floor(raw).astype(np.int64)
    left = budget - f.sum()
    order = np.argsort(-(raw - np.floor(raw)), kind="stable")
    f[order[:left]] += 1
    return f


def geometric_probs(a: float, k: int) -> np.ndarray:
    a = float(np.clip(a, EPS, 1 - EPS))
    p = (1 - a) * a ** np.arange(k + 1)
    p[k] = a ** k
    return p


def theorem_fanout(p_k: np.ndarray, r: float, budget: int) -> np.ndarray:
    return allocate(np.asarray(p_k) ** (1.0 / (1.0 + r)), budget)


@dataclass
class FanoutModel:
    """Online statistics and the fan-out lists they imply (host side, updated between chunks).

    a: per-token acceptance, r: power-law exponent of misses vs F, both fitted from rounds.
    """

    strategy: str
    k: int
    budget: int
    a: float = 0.7  # prior until rounds are observed
    r: float = 1.0
    hist: np.ndarray = field(default=None)  # accept-length counts
    rank_hits: np.ndarray = field(default=None)  # outcomes whose token ranked < F at its position

    def __post_init__(self):
        self.hist = np.zeros(self.k + 1) if self.hist is None else self.hist
        self.rank_hits = np.zeros(self.budget + 1) if self.rank_hits is None else self.rank_hits

    def observe(self, accepted: np.ndarray, ranks: np.ndarray) -> None:
        """accepted: accept counts of finished rounds; ranks: rank of the emitted token among
        the draft's glue candidates at the accept position (budget+1 when not among them)."""
        np.add.at(self.hist, np.asarray(accepted, np.int64), 1)
        np.add.at(self.rank_hits, np.minimum(np.asarray(ranks, np.int64), self.budget), 1)
        total = self.hist.sum()
        if total:
            proposed = (self.hist * np.minimum(np.arange(self.k + 1) + 1, self.k)).sum()
            self.a = float(np.clip((self.hist * np.arange(self.k + 1)).sum() / max(proposed, 1),
                                   0.05, 0.98))
        self.r = self._fit_r()

    def _fit_r(self) -> float:
        """Least squares of log miss(F) = -r log F over F = 1..budget with enough data."""
        n = self.rank_hits.sum()
        if n < 20:
            return self.r
        miss = 1.0 - np.cumsum(self.rank_hits[:-1]) / n  # miss(F) = P(rank >= F)
        F = np.arange(1, len(miss) + 1)
        ok = (miss > 1e-3) & (miss < 1)
        if ok.sum() < 2:
            return self.r
        slope = np.polyfit(np.log(F[ok]), np.log(miss[ok]), 1)[0]
        return float(np.clip(-slope, 0.2, 5.0))

    def primary(self) -> np.ndarray:
        """F_0..F_K for rows whose speculation came from the draft (cache hit / neural)."""
        K, M = self.k, self.budget
        if self.strategy == "uniform":
            return allocate(np.ones(K + 1), M)
        if self.strategy == "geometric":
            return theorem_fanout(geometric_probs(self.a, K), self.r, M)
        smoothed = (self.hist + 0.5) / (self.hist.sum() + 0.5 * (K + 1))
        return theorem_fanout(smoothed, self.r, M)

    def after_fast_backup(self) -> np.ndarray:
        """Fast-backup guesses are rarely accepted: nearly all budget to j = 0."""
        return theorem_fanout(geometric_probs(0.05, self.k), self.r, self.budget)
