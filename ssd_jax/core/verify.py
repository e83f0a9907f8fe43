"""Exact speculative verification for a batch: greedy, ratio (rejection sampling), point-mass.

Row b proposes draft tokens s_1..s_K; the target scored [r, s_1..s_K] giving p_0..p_K, where p_i is
the target's next-token distribution after s_1..s_i. The verifier returns the accepted count k and
the token t* the target emits at position k, and is lossless: the emitted tokens s_1..s_k, t* are
distributed as k+1 tokens sampled from the target (sampled rows) or are the target's argmax chain
(greedy rows).

Why the ratio rule is exact, at one position with target p and proposal q (x ~ q): a token x is
emitted by acceptance with probability q(x)·min(1, p(x)/q(x)) = min(p(x), q(x)); rejection has
probability β = 1 - Σ min(p, q) = Σ max(0, p - q), after which t* ~ max(0, p - q)/β, contributing
max(0, p(x) - q(x)). Total: min(p, q) + max(0, p - q) = p. Induction over positions gives the joint.

Why the point-mass rule is exact, for a guess x not drawn from any distribution: emit x with
probability p(x); otherwise (probability 1 - p(x)) sample p with x removed, i.e. p(y)/(1 - p(x))
for y != x. Total: p(y) for every y. (Greedy matching of guesses, as in the authors' engine, is not.)

Both need p and q to be the exact distributions used for sampling (after temperature, top-k/p and
Saguaro rescaling): see sampling.process_probs and sampling.saguaro_rescale.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from ssd_jax.sampling import sample, top1

# Sub-key tags: one stream of K uniforms for acceptance, one key for the emitted token. Fixed tags
# (not split order) keep a row's result a function of its key alone.
_ACCEPT_STREAM, _EMIT_STREAM = 0, 1


def _accept_prob_exceeds(u: Float[Array, "B K"], p_tok: Float[Array, "B K"],
                         q_tok: Float[Array, "B K"], point_mass: Bool[Array, "B 1"]) -> Array:
    """u < min(1, p/q) (ratio) or u < p (point mass), with u ~ U[0, 1).

    Written as u·q < p: no division, so q = 0 in padding gives no NaN (and a real drawn token
    always has q > 0). Since u < 1, the min(1, ·) is implicit.
    """
    q_eff = jnp.where(point_mass, 1.0, q_tok)
    return u * q_eff < p_tok


def _recovery_weights(p_k: Float[Array, "B V"], q_k: Float[Array, "B V"],
                      s_k: Int[Array, " B"], point_mass: Bool[Array, " B"]) -> Float[Array, "B V"]:
    """Unnormalised distribution of t* after a rejection at position k (sample() normalises).

    Ratio: max(0, p - q). Point mass: p with the rejected guess removed. When that has no mass
    (p == q exactly, or p a point mass on the guess) rejection had probability zero; fall back to
    p so a numerically impossible branch still yields a valid token instead of NaN.
    """
    removed = jnp.arange(p_k.shape[-1])[None, :] == s_k[:, None]
    w = jnp.where(point_mass[:, None], jnp.where(removed, 0.0, p_k), jnp.maximum(p_k - q_k, 0.0))
    return jnp.where(w.sum(-1, keepdims=True) > 0, w, p_k)


def _lookahead(target: Array, draft_tokens: Array) -> int:
    K = draft_tokens.shape[1]
    if K < 1 or target.shape[1] != K + 1:
        raise ValueError(
            f"target has {target.shape[1]} positions for K={K} draft tokens: verification needs "
            f"K+1 = {K + 1} target positions (the K proposals and the bonus) and K >= 1")
    return K


def _accepted_prefix(accept: Bool[Array, "B K"]) -> Int[Array, " B"]:
    return jnp.cumprod(accept.astype(jnp.int32), axis=-1).sum(-1)


def verify(
    target_probs: Float[Array, "B K1 V"],
    draft_tokens: Int[Array, "B K"],
    draft_probs: Float[Array, "B K V"],
    point_mass: Bool[Array, " B"],
    greedy: Bool[Array, " B"],
    keys: Key[Array, " B"],
) -> tuple[Int[Array, " B"], Int[Array, " B"]]:
    """Accepted count k in 0..K and emitted token t* per row.

    greedy rows: accept while s_{i+1} == argmax p_i, emit argmax p_k.
    sampled rows: accept s_{i+1} w.p. min(1, p_i/q_i); t* ~ norm(max(0, p_k - q_k)) after a
      rejection at k, t* ~ p_K after full acceptance.
    point-mass rows (draft_probs ignored): accept w.p. p_i(s_{i+1}); t* ~ p_k without s_{k+1}.
    K1 = K + 1 (jaxtyping cannot bind K+1 before K is seen, so it is checked here).
    """
    K = _lookahead(target_probs, draft_tokens)
    target_probs = target_probs.astype(jnp.float32)
    draft_probs = draft_probs.astype(jnp.float32)
    tok = draft_tokens[..., None]
    p_tok = jnp.take_along_axis(target_probs[:, :K], tok, axis=-1)[..., 0]  # [B, K]
    q_tok = jnp.take_along_axis(draft_probs, tok, axis=-1)[..., 0]

    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _ACCEPT_STREAM), (K,)))(keys)
    accept_sampled = _accept_prob_exceeds(u, p_tok, q_tok, point_mass[:, None])
    accept_greedy = draft_tokens == top1(target_probs[:, :K])
    n = _accepted_prefix(jnp.where(greedy[:, None], accept_greedy, accept_sampled))

    p_k = jnp.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]  # [B, V]
    j = jnp.minimum(n, K - 1)  # q and s at the rejected position (unused when n == K)
    q_k = jnp.take_along_axis(draft_probs, j[:, None, None], axis=1)[:, 0]
    s_k = jnp.take_along_axis(draft_tokens, j[:, None], axis=1)[:, 0]
    w = jnp.where((n == K)[:, None], p_k, _recovery_weights(p_k, q_k, s_k, point_mass))
    emit_keys = jax.vmap(lambda k: jax.random.fold_in(k, _EMIT_STREAM))(keys)
    t = jnp.where(greedy, top1(p_k), sample(w, emit_keys))
    return n, t


def verify_greedy(
    target_logits: Float[Array, "B K1 V"],
    draft_tokens: Int[Array, "B K"],
) -> tuple[Int[Array, " B"], Int[Array, " B"]]:
    """All-greedy fast path on raw logits: no softmax, no randomness; same result as verify()."""
    K = _lookahead(target_logits, draft_tokens)
    best = top1(target_logits)  # [B, K+1]
    n = _accepted_prefix(draft_tokens == best[:, :K])
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]
