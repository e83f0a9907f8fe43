"""The SSD speed model (paper, Theorem 7) used online to pick the backup speculator.

    speedup = [p E_hit + (1 - p) E_miss] / [p_B max(1, T_p) + (1 - p_B)(1 + T_b)]

p: per-row cache hit rate, p_B = p^B the chance that a whole batch of B rows hits (one miss
stalls the synchronous round), E_hit / E_miss: tokens a row emits per round after a hit / miss,
T_p: draft tree-build time and T_b: backup time, in units of one verification. The neural backup
(T_b > 0, good tokens: E_miss ~ E_hit) wins at small batch; the fast n-gram backup (T_b ~ 0,
E_miss ~ 1) wins once p_B is small, i.e. at large batch.
"""
from __future__ import annotations

from dataclasses import dataclass


def ssd_speedup(p: float, p_batch: float, e_hit: float, e_miss: float, t_p: float,
                t_b: float) -> float:
    return (p * e_hit + (1 - p) * e_miss) / (p_batch * max(1.0, t_p)
                                             + (1 - p_batch) * (1 + t_b))


@dataclass
class BackupChooser:
    """Online constants (priors until measured) and the choice they imply."""

    p: float = 0.8  # per-row hit rate
    e_hit: float = 3.0
    e_miss_fast: float = 1.2  # n-gram guesses are rarely accepted
    t_p: float = 0.6
    t_b: float = 0.5  # neural backup: K draft steps for the missed rows

    def observe(self, hits: int, rounds: int, tokens_hit: float | None,
                t_p: float | None = None, t_b: float | None = None) -> None:
        if rounds:
            self.p = hits / rounds
        if tokens_hit:
            self.e_hit = tokens_hit
        if t_p is not None:
            self.t_p = t_p
        if t_b is not None:
            self.t_b = t_b

    def choose(self, batch: int) -> str:
        p_b = self.p ** batch
        neural = ssd_speedup(self.p, p_b, self.e_hit, self.e_hit, self.t_p, self.t_b)
        fast = ssd_speedup(self.p, p_b, self.e_hit, self.e_miss_fast, self.t_p, 0.0)
        return "neural" if neural >= fast else "fast"
