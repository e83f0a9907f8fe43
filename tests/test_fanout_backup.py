"""Fan-out allocation, the n-gram fast backup and the speed-model backup choice, against
brute-force references."""
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.core.backups import append_tokens, ngram_propose
from ssd_jax.core.fanout import FanoutModel, allocate, geometric_probs, theorem_fanout
from ssd_jax.core.speed import BackupChooser, ssd_speedup


@pytest.mark.parametrize("budget", [4, 7, 12, 30])
def test_allocate_sums_to_budget_and_follows_weights(budget):
    w = np.array([0.5, 0.25, 0.15, 0.1])
    f = allocate(w, budget)
    assert f.sum() == budget and (f >= 0).all()
    assert list(f) == sorted(f, reverse=True)  # monotone in the weights


def test_theorem_fanout_maximises_hit_probability():
    """Brute force over all integer splits: the theorem's allocation is (near) optimal for
    sum_k P(k) (1 - F_k^-r)."""
    import itertools
    k, m, r = 3, 10, 1.0
    p = geometric_probs(0.7, k)

    def value(f):
        return sum(pk * (1 - fk ** -r) if fk else 0 for pk, fk in zip(p, f))
    best = max((f for f in itertools.product(range(m + 1), repeat=k + 1) if sum(f) == m),
               key=value)
    ours = theorem_fanout(p, r, m)
    assert value(ours) >= value(best) - 0.02


def test_fanout_model_fits_acceptance_and_power_law():
    rng = np.random.default_rng(0)
    fm = FanoutModel("geometric", 4, 12)
    # ranks with P(rank >= F) = F^-1.5 (power law), accept lengths capped-geometric a = 0.6
    u = rng.random(5000)
    ranks = np.floor(u ** (-1 / 1.5)).astype(int)  # P(rank >= F) = F^-1.5
    accepted = np.minimum(rng.geometric(1 - 0.6, 5000) - 1, 4)
    fm.observe(accepted, ranks)
    assert abs(fm.r - 1.5) < 0.3
    assert 0.45 < fm.a < 0.75
    assert fm.primary().sum() == 12 and fm.after_fast_backup()[0] == fm.after_fast_backup().max()


def _brute_ngram(hist, length, k, max_n=3):
    seq = list(hist[:length])
    for n in range(max_n, 0, -1):
        tail = seq[-n:]
        for p in range(length - 2, n - 2, -1):
            if seq[p - n + 1:p + 1] == tail:
                return [seq[min(p + 1 + i, length - 1)] for i in range(k)]
    return [seq[-1]] * k


def test_ngram_matches_brute_force():
    rng = np.random.default_rng(1)
    hist = rng.integers(0, 5, size=(16, 40))
    lengths = rng.integers(2, 40, size=16)
    got = np.asarray(ngram_propose(jnp.asarray(hist), jnp.asarray(lengths), 4))
    for b in range(16):
        assert list(got[b]) == _brute_ngram(list(hist[b]), lengths[b], 4), b


def test_append_tokens():
    h = np.zeros((2, 8), np.int32)
    out = np.asarray(append_tokens(jnp.asarray(h), jnp.array([2, 6]),
                                   jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([3, 2])))
    assert out.tolist() == [[0, 0, 1, 2, 3, 0, 0, 0], [0, 0, 0, 0, 0, 0, 4, 5]]


def test_backup_choice_follows_batch_size():
    ch = BackupChooser(p=0.85, e_hit=3.0, e_miss_fast=1.2, t_p=0.6, t_b=0.6)
    assert ch.choose(1) == "neural"
    assert ch.choose(64) == "fast"
    # at p = 1 the backup never runs; at p = 0 SSD is SD with a backup
    assert ssd_speedup(1.0, 1.0, 3.0, 1.0, 0.5, 9.0) == 3.0
    assert ssd_speedup(0.0, 0.0, 3.0, 2.0, 0.5, 1.0) == 1.0
