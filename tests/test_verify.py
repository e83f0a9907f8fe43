"""verify.py: exact distributions by enumeration, losslessness, and statistical tests with teeth.

Setting: V=4, K=2. Target and draft are prefix-dependent tables (P[prefix], Q[prefix]), as real
models are, so the check is about sequences, not one position. Three independent oracles:
  1. an enumeration in float64 of the verification rule (docs section 5), giving the exact law of
     (s_1, s_2, k, t*) and, from it, the exact law of the emitted text;
  2. the target's own joint law P(x1) P(x2|x1) P(x3|x1,x2), which the emitted tokens, continued by
     plain target sampling up to K+1 tokens, must follow (losslessness);
  3. chi-square tests of the JAX implementation's draws against both.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax import sampling
from ssd_jax.core import verify as verify_mod
from tests.oracles import P_MIN, chi2_pvalue

V, K, N = 4, 2, 100_000


_process = jax.jit(sampling.process_probs)
_verify = jax.jit(verify_mod.verify)


def prefix_tables(logits, temperature, top_k=0, top_p=1.0):
    """Per-prefix distributions [V], [V,V], [V,V,V] through the library's processing."""
    flat = np.concatenate([z.reshape(-1, V) for z in logits])  # all 1+4+16 prefixes, one call
    rows = len(flat)
    p = _process(jnp.asarray(flat, jnp.float32), jnp.full(rows, temperature, jnp.float32),
                 jnp.full(rows, top_k, jnp.int32), jnp.full(rows, top_p, jnp.float32))
    splits = np.cumsum([z.size // V for z in logits])[:-1]
    return [simplex(t.reshape(z.shape)) for t, z in zip(np.split(np.asarray(p), splits), logits)]


def simplex(t):
    """float64, renormalised: the oracles then hold to 1e-12, not to fp32 rounding."""
    t = np.asarray(t, np.float64)
    return t / t.sum(-1, keepdims=True)


def rescaled(Q):
    return [simplex(sampling.saguaro_rescale(jnp.asarray(q, jnp.float32), 2, 0.3)) for q in Q]


def random_logits(seed, scale=1.5):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(V,) * (i + 1)) * scale for i in range(K + 1)]


def dist(tables, prefix):
    return tables[len(prefix)][tuple(prefix)]


def scenario(name):
    """(P tables, Q tables the drafts are drawn from, Q tables given to verify, point_mass)."""
    zt = random_logits(0)
    zd = [z + n for z, n in zip(zt, random_logits(1, scale=1.0))]  # correlated, like a draft
    P = prefix_tables(zt, 1.0)
    if name == "ratio":
        Q = prefix_tables(zd, 1.0)
        return P, Q, Q, False
    if name == "saguaro":
        Q = rescaled(prefix_tables(zd, 1.0))
        return P, Q, Q, False
    if name == "saguaro_unscaled_q":  # bug: draft from q', verify against q
        Q = prefix_tables(zd, 1.0)
        return P, rescaled(Q), Q, False
    if name == "point_mass":  # guesses drawn independently of the target's randomness
        Q = prefix_tables(zd, 1.0)
        return P, Q, [np.zeros_like(q) for q in Q], True
    if name == "top_p":
        P = prefix_tables(zt, 0.8, top_p=0.8)
        Q = prefix_tables(zd, 1.2, top_k=3, top_p=0.9)
        return P, Q, Q, False
    if name == "greedy_draft":  # draft at T=0 (one-hot q), sampled target
        Q = prefix_tables(zd, 0.0)
        return P, Q, Q, False
    raise ValueError(name)


def exact_outcomes(P, Q, point_mass):
    """Exact law of (s1, s2, k, t) under the section-5 rule, by enumeration in float64."""
    law = np.zeros((V,) * K + (K + 1, V))
    for s in itertools.product(range(V), repeat=K):
        prob_s = np.prod([dist(Q, s[:i])[s[i]] for i in range(K)])
        alive = 1.0
        for i in range(K):
            p, q = dist(P, s[:i]), dist(Q, s[:i])
            a = p[s[i]] if point_mass else min(1.0, p[s[i]] / q[s[i]]) if q[s[i]] > 0 else 1.0
            if alive * (1 - a) > 0:
                w = p.copy()
                if point_mass:
                    w[s[i]] = 0.0
                else:
                    w = np.maximum(p - q, 0.0)
                law[s + (i,)] += prob_s * alive * (1 - a) * w / w.sum()
            alive *= a
        law[s + (K,)] += prob_s * alive * dist(P, s)
    return law


def target_joint(P):
    """P(x1..x_{K+1}) of plain target sampling."""
    out = np.zeros((V,) * (K + 1))
    for x in itertools.product(range(V), repeat=K + 1):
        out[x] = np.prod([dist(P, x[:i])[x[i]] for i in range(K + 1)])
    return out


def continued_law(P, law):
    """Law of the first K+1 tokens when the emitted s_1..s_k, t* are continued by the target."""
    out = np.zeros((V,) * (K + 1))
    for idx in itertools.product(*(range(n) for n in law.shape)):
        if law[idx] == 0:
            continue
        *s, k, t = idx
        emitted = tuple(s[:k]) + (t,)
        for rest in itertools.product(range(V), repeat=K - k):
            x = emitted + rest
            out[x] += law[idx] * np.prod([dist(P, x[:i])[x[i]] for i in range(k + 1, K + 1)])
    return out


@pytest.mark.parametrize("name", ["ratio", "saguaro", "point_mass", "top_p", "greedy_draft"])
def test_rule_is_lossless_exactly(name):
    P, Qdraw, Qver, pm = scenario(name)
    assert Qdraw is Qver or pm
    law = exact_outcomes(P, Qdraw, pm)
    np.testing.assert_allclose(law.sum(), 1.0, atol=1e-12)
    # First emitted token: s_1 if k >= 1 else t*. Its law must be p_0 exactly.
    first = law[:, :, 1:, :].sum(axis=(1, 2, 3)) + law[:, :, 0, :].sum(axis=(0, 1))
    np.testing.assert_allclose(first, P[0], atol=1e-12)
    np.testing.assert_allclose(continued_law(P, law), target_joint(P), atol=1e-12)


def draw(rng, probs):
    """Inverse-CDF draws per row; zero-probability tokens have empty intervals."""
    c = np.cumsum(probs, axis=1)
    c /= c[:, -1:]
    return (rng.random((len(probs), 1)) >= c).sum(1)


# The draws' seed. For an exact rule each p-value is uniform on [0, 1], so a fixed seed fails
# one with probability P_MIN: seed 0 gave point_mass's (s, k, t*) law p = 8.5e-4 once the
# sampler drew in two stages (session 52), where seeds 1-25 gave 0.11-0.98, uniform by a KS
# test (p = 0.51). The planted wrong rules below fail at this seed as at 0.
SEED = 1


def run_verify(P, Qdraw, Qver, pm, seed=SEED, patched=False):
    """Draft N sequences from Qdraw, verify them with the library; returns s, k, t, continued x."""
    rng = np.random.default_rng(seed)
    s = np.zeros((N, K), np.int64)
    for i in range(K):
        s[:, i] = draw(rng, Qdraw[i][tuple(s[:, :i].T)] if i else
                       np.broadcast_to(Qdraw[0], (N, V)))
    tp = np.stack([P[0][None].repeat(N, 0)] + [P[i][tuple(s[:, :i].T)] for i in range(1, K + 1)], 1)
    dp = np.stack([Qver[0][None].repeat(N, 0)] + [Qver[i][tuple(s[:, :i].T)] for i in range(1, K)], 1)
    keys = jax.random.split(jax.random.key(seed), N)
    # A patched internal (teeth tests) needs a fresh trace; the real one reuses the compiled _verify.
    fn = jax.jit(lambda *a: verify_mod.verify(*a)) if patched else _verify
    k, t = fn(
        jnp.asarray(tp, jnp.float32), jnp.asarray(s, jnp.int32), jnp.asarray(dp, jnp.float32),
        jnp.full((N,), pm), jnp.zeros((N,), bool), keys)
    k, t = np.asarray(k), np.asarray(t)
    x = np.zeros((N, K + 1), np.int64)  # emitted tokens continued by plain target sampling
    for j in range(K + 1):
        mine = np.where(j < k, s[:, min(j, K - 1)], t)
        cont = draw(rng, P[j][tuple(x[:, :j].T)]) if j else mine
        x[:, j] = np.where(j <= k, mine, cont)
    return s, k, t, x


def statistical_pvalues(P, Qdraw, Qver, pm, patched=False):
    s, k, t, x = run_verify(P, Qdraw, Qver, pm, patched=patched)
    law = exact_outcomes(P, Qdraw, pm)
    cells = np.ravel_multi_index(tuple(s.T) + (k, t), law.shape)
    p_law = chi2_pvalue(np.bincount(cells, minlength=law.size), law.ravel())
    p_first = chi2_pvalue(np.bincount(x[:, 0], minlength=V), P[0])
    joint = target_joint(P)
    p_joint = chi2_pvalue(np.bincount(np.ravel_multi_index(tuple(x.T), joint.shape),
                                      minlength=joint.size), joint.ravel())
    return p_law, p_first, p_joint


@pytest.mark.parametrize("name", ["ratio", "saguaro", "point_mass", "top_p", "greedy_draft"])
def test_verify_samples_the_exact_law_and_the_target(name):
    p_law, p_first, p_joint = statistical_pvalues(*scenario(name))
    assert p_law > P_MIN, f"(s, k, t*) deviates from the enumerated law: p={p_law:.2e}"
    assert p_first > P_MIN, f"first emitted token deviates from p_0: p={p_first:.2e}"
    assert p_joint > P_MIN, f"emitted text deviates from the target: p={p_joint:.2e}"


def _recover_from_p(p_k, q_k, s_k, point_mass):
    return p_k


def _point_mass_keeps_guess(p_k, q_k, s_k, point_mass):
    return jnp.where(point_mass[:, None], p_k, jnp.maximum(p_k - q_k, 0.0))


@pytest.mark.parametrize("name,patch", [
    ("ratio", _recover_from_p),
    ("point_mass", _point_mass_keeps_guess),
    ("saguaro_unscaled_q", None),
])
def test_statistical_test_has_teeth(monkeypatch, name, patch):
    """Known-wrong rules must be caught by the very test the real rule passes."""
    if patch is not None:
        monkeypatch.setattr(verify_mod, "_recovery_weights", patch)
    P, Qdraw, Qver, pm = scenario(name)
    _, p_first, p_joint = statistical_pvalues(P, Qdraw, Qver, pm, patched=patch is not None)
    assert p_first < P_MIN and p_joint < P_MIN, (p_first, p_joint)


def test_greedy_matches_python_loop():
    B, Kg, Vg = 256, 4, 6
    rng = np.random.default_rng(3)
    logits = rng.integers(0, 3, size=(B, Kg + 1, Vg)).astype(np.float32)  # many argmax ties
    best = logits.argmax(-1)
    draft = np.where(rng.random((B, Kg)) < 0.8, best[:, :Kg], rng.integers(0, Vg, (B, Kg)))
    want_k, want_t = [], []
    for b in range(B):
        n = 0
        while n < Kg and draft[b, n] == int(np.argmax(logits[b, n])):
            n += 1
        want_k.append(n)
        want_t.append(int(np.argmax(logits[b, n])))
    assert set(want_k) == set(range(Kg + 1))  # every outcome exercised

    k, t = jax.jit(verify_mod.verify_greedy)(
        jnp.asarray(logits), jnp.asarray(draft, jnp.int32))
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(t, want_t)

    # The general path, greedy rows (probs are one-hot after process_probs at T=0).
    probs = _process(jnp.asarray(logits), jnp.zeros(B), jnp.zeros(B, jnp.int32),
                                   jnp.ones(B))
    k2, t2 = jax.jit(verify_mod.verify)(
        probs, jnp.asarray(draft, jnp.int32), jnp.full((B, Kg, Vg), 1.0 / Vg),
        jnp.zeros(B, bool), jnp.ones(B, bool), jax.random.split(jax.random.key(0), B))
    np.testing.assert_array_equal(k2, want_k)
    np.testing.assert_array_equal(t2, want_t)


def test_rows_are_independent_and_deterministic():
    """A row's outcome depends only on its own inputs and key, whatever its neighbours are."""
    rng = np.random.default_rng(4)
    B = 12
    tp = jnp.asarray(rng.dirichlet(np.ones(V), size=(B, K + 1)), jnp.float32)
    dp = jnp.asarray(rng.dirichlet(np.ones(V), size=(B, K)), jnp.float32)
    s = jnp.asarray(rng.integers(0, V, (B, K)), jnp.int32)
    pm = jnp.asarray(np.arange(B) % 3 == 1)
    greedy = jnp.asarray(np.arange(B) % 3 == 2)
    keys = jax.random.split(jax.random.key(5), B)
    k, t = _verify(tp, s, dp, pm, greedy, keys)
    perm = rng.permutation(B)
    k2, t2 = _verify(tp[perm], s[perm], dp[perm], pm[perm], greedy[perm], keys[perm])
    np.testing.assert_array_equal(k[perm], k2)
    np.testing.assert_array_equal(t[perm], t2)
    k3, t3 = _verify(tp, s, dp, pm, greedy, keys)
    np.testing.assert_array_equal(k, k3)
    np.testing.assert_array_equal(t, t3)
    assert 0 < int((k[~greedy] < K).sum()) < int((~greedy).sum())  # both branches exercised


def test_padding_and_zero_residual_give_valid_tokens():
    p = np.array([0.0, 0.5, 0.5, 0.0], np.float32)
    tp = jnp.asarray(np.broadcast_to(p, (4, K + 1, V)))
    # Row 0: token 0 has q = p = 0 (padding): rejected, and max(0, p - q) is empty because
    #        p == q -> fall back to p.
    # Row 1: p == q exactly: the draft is always accepted (u < 1 = p/q).
    # Row 2: point mass on a token p rules out: always rejected, t* from p.
    # Row 3: draft tokens with q = 0 (impossible draws) and p > 0: no NaN, accepted.
    dp = np.broadcast_to(p, (4, K, V)).copy()
    dp[3] = 0.0
    s = jnp.asarray([[0, 0], [1, 2], [3, 3], [1, 1]], jnp.int32)
    pm = jnp.asarray([False, False, True, False])
    reps = 50  # the same four rows under many keys
    tile = lambda a: jnp.tile(jnp.asarray(a), (reps,) + (1,) * (np.ndim(a) - 1))
    keys = jax.random.split(jax.random.key(6), 4 * reps)
    k, t = _verify(tile(tp), tile(s), tile(dp), tile(pm), jnp.zeros(4 * reps, bool), keys)
    np.testing.assert_array_equal(k, np.tile([0, K, 0, K], reps))
    assert set(np.asarray(t).tolist()) == {1, 2}


def test_bad_lookahead_is_reported():
    with pytest.raises(ValueError, match="K\\+1"):
        verify_mod.verify_greedy(jnp.zeros((1, 2, V)), jnp.zeros((1, 2), jnp.int32))
