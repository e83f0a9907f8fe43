"""sampling.py against brute-force numpy references and exact distributions (chi-square)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax import sampling
from tests.oracles import P_MIN, chi2_pvalue


def ranking(probs):
    """Token ids by (prob desc, id asc): the tie rule the library documents."""
    return sorted(range(len(probs)), key=lambda i: (-probs[i], i))


def np_process(logits, temperature, top_k, top_p, min_p=0.0):
    """Brute force in float64: softmax, drop the tokens below min_p times the top one's, keep
    the first top_k ranks, then the smallest prefix of ranks whose mass reaches top_p (tried
    size by size), renormalise."""
    logits = np.asarray(logits, np.float64)
    V = len(logits)
    if temperature == 0:
        return np.eye(V)[int(np.argmax(logits))]
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    p = np.where(p >= min_p * p.max(), p, 0.0)
    kept = ranking(p)[: top_k if 0 < top_k <= V else V]
    kept = [i for i in kept if p[i] > 0]
    mass = p[kept].sum()
    if top_p < 1.0:
        for n in range(1, len(kept) + 1):
            if p[kept[:n]].sum() / mass >= top_p - sampling.TOP_P_SLACK:
                kept = kept[:n]
                break
    out = np.zeros(V)
    out[kept] = p[kept]
    return out / out.sum()


LOG = np.log
# (logits, temperature, top_k, top_p): hand-made so every boundary case is exact.
CASES = [
    ([1.0, 2.0, 0.5, -1.0, 0.0], 1.0, 0, 1.0),            # plain softmax
    ([1.0, 2.0, 0.5, -1.0, 0.0], 0.5, 0, 1.0),            # temperature
    ([1.0, 3.0, 3.0, -1.0, 3.0], 0.0, 0, 1.0),            # greedy, tie -> lowest index (1)
    ([1.0, 3.0, 2.0, 2.0, 0.0], 1.0, 2, 1.0),             # top-k tie at the boundary: keep 1, 2
    ([1.0, 3.0, 2.0, 2.0, 0.0], 1.0, 7, 1.0),             # top_k > V is off
    ([1.0, 3.0, 2.0, 2.0, 0.0], 1.0, 1, 1.0),             # top_k = 1 is argmax
    (LOG([0.5, 0.25, 0.125, 0.125, 1e-9]), 1.0, 0, 0.75),  # mass exactly reaches top_p: 2 kept
    (LOG([0.5, 0.25, 0.125, 0.125, 1e-9]), 1.0, 0, 0.7501),  # just past: 3 kept
    (LOG([0.5, 0.25, 0.125, 0.125, 1e-9]), 1.0, 0, 0.7499),  # just short: 2 kept
    (LOG([0.5, 0.25, 0.125, 0.125, 1e-9]), 1.0, 0, 0.3),   # top token alone reaches it
    (LOG([0.5, 0.25, 0.125, 0.125, 1e-9]), 1.0, 0, 0.0),   # top_p = 0 still keeps one token
    (LOG([0.4, 0.2, 0.2, 0.2, 1e-9]), 1.0, 0, 0.6),        # top-p tie at the boundary: keep 0, 1
    ([0.3, -0.2, 1.1, 0.9, 0.8], 0.7, 3, 0.8),            # top-k then top-p on the renormalised
    ([0.3, -np.inf, 1.1, 0.9, -np.inf], 1.3, 0, 0.95),    # masked logits
    ([0.3, -np.inf, 1.1, 0.9, -np.inf], 1.0, 4, 1.0),     # top_k beyond the finite tokens
]


# (logits, temperature, top_k, top_p, min_p)
MIN_P_CASES = [
    (LOG([0.5, 0.25, 0.125, 0.0625, 0.0625]), 1.0, 0, 1.0, 0.24),  # floor 0.12: 3 kept
    (LOG([0.5, 0.25, 0.125, 0.0625, 0.0625]), 1.0, 0, 1.0, 0.26),  # floor 0.13: 2 kept
    (LOG([0.5, 0.25, 0.125, 0.0625, 0.0625]), 1.0, 0, 1.0, 1.0),   # the top token alone
    (LOG([0.5, 0.25, 0.125, 0.0625, 0.0625]), 0.5, 0, 1.0, 0.2),   # after temperature: 2 kept
    (LOG([0.5, 0.25, 0.125, 0.0625, 0.0625]), 1.0, 0, 0.6, 0.2),   # then top-p on what is left
    (LOG([0.5, 0.25, 0.125, 0.0625, 0.0625]), 1.0, 2, 1.0, 0.2),   # then top-k
    (LOG([0.5, 0.25, 0.125, 0.0625, 0.0625]), 0.0, 0, 1.0, 0.9),   # greedy ignores it
    (LOG([0.5, 0.25, 0.125, 0.0625, 0.0625]), 1.0, 0, 1.0, 0.0),   # off
]


def test_min_p_matches_bruteforce_and_leaves_other_rows_alone():
    logits, t, k, p, m = zip(*MIN_P_CASES)
    got = jax.jit(sampling.process_probs)(
        jnp.asarray(np.array(logits), jnp.float32), jnp.asarray(t, jnp.float32),
        jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32), jnp.asarray(m, jnp.float32))
    np.testing.assert_allclose(got, np.stack([np_process(*c) for c in MIN_P_CASES]), atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got[0]) > 0, [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(got[1]) > 0, [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(got[3]) > 0, [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(got[4]) > 0, [1, 1, 0, 0, 0])  # 0.5/0.875 < 0.6
    # min_p = 0 is the function without it, bit for bit.
    off = sampling.process_probs(*_batch([c[:4] for c in MIN_P_CASES]))
    np.testing.assert_array_equal(got[-1], off[-1])


def _batch(cases):
    logits, t, k, p = zip(*cases)
    return (jnp.asarray(np.array(logits), jnp.float32), jnp.asarray(t, jnp.float32),
            jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32))


def test_process_probs_matches_bruteforce():
    got = jax.jit(sampling.process_probs)(*_batch(CASES))
    want = np.stack([np_process(*c) for c in CASES])
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=2e-6)
    # The boundary cases, spelled out (independent of the oracle's code).
    np.testing.assert_array_equal(np.asarray(got[3]) > 0, [0, 1, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(got[6]) > 0, [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(got[7]) > 0, [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(got[11]) > 0, [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(got[2], np.eye(5)[1])


def test_process_probs_without_truncation_skips_sort_branch_correctly():
    plain = [c for c in CASES if c[2] == 0 and c[3] >= 1.0]
    got = jax.jit(sampling.process_probs)(*_batch(plain))
    np.testing.assert_allclose(got, np.stack([np_process(*c) for c in plain]), atol=2e-6)


def test_process_probs_broadcasts_row_settings_over_middle_axes():
    # [B, S, V]: each row's settings apply to all S positions; positions use different logits.
    rows = CASES[:6]
    logits, t, k, p = _batch(rows)
    rolled = jnp.stack([jnp.roll(logits, s, axis=-1) for s in range(3)], axis=1)  # [B, 3, V]
    got = sampling.process_probs(rolled, t, k, p)
    for b, (_, tb, kb, pb) in enumerate(rows):
        for s in range(3):
            np.testing.assert_allclose(
                got[b, s], np_process(np.asarray(rolled[b, s]), tb, kb, pb), atol=2e-6)


def test_sample_frequencies_match_probs():
    probs = np.array([0.5, 0.3, 0.0, 0.199, 0.001], np.float32)
    n = 200_000
    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.jit(sampling.sample)(jnp.broadcast_to(probs, (n, 5)), keys)
    counts = np.bincount(np.asarray(draws), minlength=5)
    assert counts[2] == 0
    assert chi2_pvalue(counts, probs) > P_MIN
    # Gumbel-max is scale invariant: unnormalised weights give the same draws for the same keys.
    again = sampling.sample(jnp.broadcast_to(probs * 7.0, (n, 5)), keys)
    np.testing.assert_array_equal(draws, again)


def test_sample_over_blocks_matches_probs():
    """A vocabulary of many blocks (the sampler draws a block by its mass, then a token in it):
    mass spread over blocks of very different weight, whole blocks at zero, a token alone in
    the padded last block; the frequencies match p (chi-square), zeros are never drawn."""
    V = 1000  # blocks of 32: 31 full ones and a last one of 8 tokens, padded
    assert sampling._block_width(V) == 32
    probs = np.zeros(V, np.float32)
    probs[[0, 1, 33, 500, 531, 999]] = [0.3, 0.05, 0.2, 0.1, 0.25, 0.1]
    n = 100_000
    keys = jax.random.split(jax.random.key(3), n)
    draws = np.asarray(jax.jit(sampling.sample)(jnp.broadcast_to(probs, (n, V)), keys))
    counts = np.bincount(draws, minlength=V)
    assert counts[probs == 0].sum() == 0
    live = probs > 0
    assert chi2_pvalue(counts[live], probs[live]) > P_MIN


def test_sample_never_picks_zero_probability():
    n, V = 4096, 8
    keys = jax.random.split(jax.random.key(1), n)
    probs = np.zeros((n, V), np.float32)
    probs[:, 3] = 1e-30  # one tiny-but-positive token among zeros must always be the pick
    probs[::2, 6] = 1.0
    draws = np.asarray(sampling.sample(jnp.asarray(probs), keys))
    np.testing.assert_array_equal(draws[::2], 6)
    np.testing.assert_array_equal(draws[1::2], 3)


def test_next_token_greedy_and_sampled_rows():
    logits = jnp.asarray([[0.2, 1.5, 1.5, -0.3, 0.9, 0.0]] * 4, jnp.float32)
    t = jnp.asarray([0.0, 0.7, 0.7, 1.0], jnp.float32)
    k = jnp.asarray([0, 3, 1, 0], jnp.int32)
    p = jnp.asarray([1.0, 0.9, 1.0, 1.0], jnp.float32)
    n = 50_000
    keys = jax.random.split(jax.random.key(2), (n, 4))
    step = jax.jit(jax.vmap(sampling.next_token, in_axes=(None, None, None, None, 0)))
    toks = np.asarray(step(logits, t, k, p, keys))  # [n, 4]
    np.testing.assert_array_equal(toks[:, 0], 1)  # greedy: first of the tied maxima
    np.testing.assert_array_equal(toks[:, 2], 1)  # top_k=1 agrees with greedy on ties
    for row in (1, 3):
        want = np_process(np.asarray(logits[row]), float(t[row]), int(k[row]), float(p[row]))
        counts = np.bincount(toks[:, row], minlength=6)
        assert chi2_pvalue(counts, want) > P_MIN


def np_saguaro(q, num_top, c):
    top = ranking(q)[:num_top]
    out = np.array(q, np.float64)
    out[top] *= c
    return out / out.sum()


def test_saguaro_rescale_matches_reference():
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.ones(6), size=(3, 2)).astype(np.float32)  # [B=3, K=2, V=6]
    q[0, 0] = [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]  # tie at the top-2 boundary and inside
    q[1, 1] = [0.1, 0.3, 0.1, 0.4, 0.1, 0.0]  # tie at the top-3 boundary: ids 0 and 2 -> 0
    c = np.array([0.3, 0.5, 1.0], np.float32)
    for num_top in (1, 2, 3):
        got = jax.jit(sampling.saguaro_rescale, static_argnums=1)(
            jnp.asarray(q), num_top, jnp.asarray(c))
        for b, j in itertools.product(range(3), range(2)):
            np.testing.assert_allclose(got[b, j], np_saguaro(q[b, j], num_top, c[b]), atol=1e-6)
    got = sampling.saguaro_rescale(jnp.asarray(q), 2, 0.25)  # scalar C
    np.testing.assert_allclose(got[1, 1], np_saguaro(q[1, 1], 2, 0.25), atol=1e-6)
    np.testing.assert_allclose(got[1, 1, 5], 0.0)  # zeros stay zero: q' never invents support


def test_saguaro_rescale_per_row_counts_match_reference():
    """The draft's form: a per-row fan-out count (0 = no fork at that position) and per-row C.
    Ties at the boundary scale exactly num_top tokens, lowest ids first, which is the set
    `lax.top_k` hands the fork."""
    q = np.array([[[0.3, 0.3, 0.3, 0.1]],
                  [[0.1, 0.3, 0.1, 0.4]],
                  [[0.25, 0.25, 0.25, 0.25]]], np.float32)  # [B=3, N=1, V=4]
    num_top = np.array([1, 2, 0], np.int32)
    c = np.array([0.5, 0.2, 0.3], np.float32)
    got = jax.jit(sampling.saguaro_rescale, static_argnums=3)(
        jnp.asarray(q), jnp.asarray(num_top), jnp.asarray(c), 3)
    for b in range(3):
        np.testing.assert_allclose(got[b, 0], np_saguaro(q[b, 0], num_top[b], c[b]), atol=1e-6)
    np.testing.assert_allclose(got[0, 0], [0.15 / 0.85, 0.3 / 0.85, 0.3 / 0.85, 0.1 / 0.85],
                               atol=1e-6)
    with pytest.raises(ValueError, match="fmax"):
        sampling.saguaro_rescale(jnp.asarray(q), jnp.asarray(num_top), 0.5)


@pytest.mark.parametrize("num_top,c", [(2, 1.0), (0, 0.3), (9, 0.3)])
def test_saguaro_rescale_identity_cases(num_top, c):
    q = jnp.asarray(np.random.default_rng(1).dirichlet(np.ones(5), size=4), jnp.float32)
    # C = 1 changes nothing; num_top = 0 scales nothing; num_top >= V scales everything equally.
    np.testing.assert_allclose(sampling.saguaro_rescale(q, num_top, c), q, atol=1e-6)


def test_shape_annotations_are_checked():
    """The test run's import hook (conftest) checks every annotated call: a [B] array of floats
    where sample() takes [B] keys is refused, as is a probs row count that differs from B."""
    from jaxtyping import TypeCheckError
    probs = jnp.full((3, 4), 0.25)
    with pytest.raises(TypeCheckError, match="keys"):
        sampling.sample(probs, jnp.ones((3,)))
    with pytest.raises(TypeCheckError):
        sampling.sample(probs, jax.random.split(jax.random.key(0), 2))


def test_add_bias_matches_numpy_and_padding_adds_nothing():
    """logit_bias: each row's (id, value) pairs added at every middle position; a row padded
    with (0, 0.0) keeps its logits bit for bit (unbiased rows run the same programs)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 2, 7)).astype(np.float32)
    ids = np.array([[2, 5, 0], [0, 0, 0], [6, 6, 1]], np.int32)  # row 2 biases id 6 twice
    vals = np.array([[1.5, -100.0, 0.0], [0.0, 0.0, 0.0], [0.25, 0.5, -2.0]], np.float32)
    got = np.asarray(sampling.add_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(vals)))
    want = logits.copy()
    for b in range(3):
        for t, v in zip(ids[b], vals[b]):
            want[b, :, t] += v
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.array_equal(got[1], logits[1])


def test_top1_is_the_lowest_index_argmax():
    """top1 (lax.top_k on a CPU) against numpy's argmax, ties included, over batch axes."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(3, 5, 40)).astype(np.float32)  # many ties at the top
    assert (np.asarray(jax.jit(sampling.top1)(jnp.asarray(x))) == x.argmax(-1)).all()
    y = rng.normal(size=(2, 151936)).astype(np.float32)
    assert (np.asarray(sampling.top1(jnp.asarray(y))) == y.argmax(-1)).all()
