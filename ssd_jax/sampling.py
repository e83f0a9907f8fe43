"""Token distributions and sampling: temperature / min-p / top-k / top-p, two-stage Gumbel-max,
Saguaro rescaling.

`process_probs` is *the* definition of a row's distribution. The AR engine samples from it, the
draft samples speculated tokens from it (optionally Saguaro-rescaled), and verification compares
the target's and the draft's versions of it. Speculative decoding is lossless with respect to
whatever distribution both sides agree on, so every logit processing step lives here, once.

Everything is pure and jittable; per-row settings are arrays of shape [B] so one compiled program
serves a batch with mixed temperatures. Randomness comes from one typed PRNG key per row
(`jax.random.key` / `split` / `fold_in`), so a row's result never depends on its batch neighbours.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

# top-p keeps the smallest set of tokens whose mass reaches top_p. Mass is summed in fp32, so a set
# whose exact mass equals top_p can come out a few ulps short; this slack makes that edge resolve
# as in exact arithmetic. The cost is at most 1e-6 of probability mass moved at the boundary.
TOP_P_SLACK = 1e-6


def top1(x: Float[Array, "*S V"]) -> Int[Array, "*S"]:
    """argmax over the last axis (ties -> lowest index), int32. On a CPU it is lax.top_k(x, 1):
    XLA:CPU's argmax, a two-operand reduction, took 2.5x the top-k custom call's time over a
    152k vocabulary (3.5 against 1.4 ms for 6 rows on one vCPU); other platforms keep argmax."""
    return jax.lax.platform_dependent(
        x, cpu=lambda x: jax.lax.top_k(x, 1)[1][..., 0].astype(jnp.int32),
        default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def _per_row(x: Array, ndim: int) -> Array:
    """[B] -> [B, 1, ..., 1] so per-row settings broadcast over middle axes and the vocab."""
    x = jnp.asarray(x)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _ranked_at_or_above(p: Float[Array, "*S V"], cut_idx: Int[Array, "*S 1"]) -> Array:
    """Mask of the tokens ranked at or above token `cut_idx` in the order (prob desc, index asc).

    Cheaper than scattering a sorted mask back (a second sort on XLA): one gather, then
    elementwise comparisons.
    """
    cut_p = jnp.take_along_axis(p, cut_idx, axis=-1)
    idx = jnp.arange(p.shape[-1])
    return (p > cut_p) | ((p == cut_p) & (idx <= cut_idx))


def _truncate(p: Float[Array, "*S V"], top_k: Int[Array, "*S"],
              top_p: Float[Array, "*S"]) -> Float[Array, "*S V"]:
    V = p.shape[-1]
    # Stable sort on -p ranks ties by lowest index first, the same convention as jnp.argmax, so
    # top_k=1 and greedy agree.
    order = jnp.argsort(-p, axis=-1, stable=True)
    sorted_p = jnp.take_along_axis(p, order, axis=-1)
    k = jnp.where((top_k <= 0) | (top_k > V), V, top_k)
    rank = jnp.arange(V)
    sorted_p = jnp.where(rank < k[..., None], sorted_p, 0.0)
    # top-p acts on the top-k distribution renormalised (the usual k-then-p order). Rank r is
    # kept iff the mass strictly above it is still short of top_p: that is the smallest prefix
    # reaching top_p, and rank 0 (mass above = 0) is always kept.
    sorted_p = sorted_p / sorted_p.sum(-1, keepdims=True)
    above = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = (sorted_p > 0) & ((above < top_p[..., None] - TOP_P_SLACK)
                                    | (top_p[..., None] >= 1.0) | (rank == 0))
    n = keep_sorted.sum(-1, keepdims=True)  # kept ranks form a prefix 0..n-1
    keep = _ranked_at_or_above(p, jnp.take_along_axis(order, n - 1, axis=-1))
    return jnp.where(keep, p, 0.0)


def add_bias(logits: Float[Array, "B *S V"], ids: Int[Array, "B W"], bias: Float[Array, "B W"]
             ) -> Float[Array, "B *S V"]:
    """Each row's logit bias (OpenAI's `logit_bias`: token id -> a value added to its logit)
    added at every middle position. Padding entries (id 0, bias 0) add exactly nothing, so
    rows without a bias keep their logits bit for bit. The target's biased law is what the
    output follows; the draft proposes from biased logits too (speculation.steer), which only
    moves acceptance: verification stays exact whatever the draft proposes."""
    B, V = logits.shape[0], logits.shape[-1]
    dense = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], ids].add(
        bias.astype(jnp.float32))
    return logits + dense.reshape((B,) + (1,) * (logits.ndim - 2) + (V,))


def penalize(logits: Float[Array, "B S V"], counts: Int[Array, "B S V"],
             in_prompt: Bool[Array, "B V"], presence: Float[Array, " B"],
             frequency: Float[Array, " B"], repetition: Float[Array, " B"]
             ) -> Float[Array, "B S V"]:
    """Each row's penalties at each position, given how often each token appeared in the
    answer before that position (`counts`) and which tokens the prompt holds. The rules are
    vLLM's (and OpenAI's for presence and frequency): a token seen in the prompt or the answer
    has its logit divided by `repetition` when positive, multiplied when negative; then a token
    the answer holds loses `frequency` per occurrence and `presence` once. Rows whose settings
    are 0, 0 and 1 keep their logits bit for bit."""
    logits = logits.astype(jnp.float32)
    in_answer = counts > 0
    rep = repetition[:, None, None]
    seen = in_answer | in_prompt[:, None, :]
    logits = jnp.where(seen & (rep != 1.0), jnp.where(logits > 0, logits / rep, logits * rep),
                       logits)
    return (logits - frequency[:, None, None] * counts.astype(jnp.float32)
            - presence[:, None, None] * in_answer.astype(jnp.float32))


def process_probs(
    logits: Float[Array, "B *S V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    min_p: Float[Array, " B"] | None = None,
) -> Float[Array, "B *S V"]:
    """softmax(logits / T), then min-p (0 = off; None: no row uses it), then top-k (0 = off),
    then top-p (1.0 = off), renormalised, fp32.

    Rows with T == 0 get a one-hot at argmax (ties -> lowest index). Per-row settings apply to
    every middle position (e.g. all K+1 verified positions of a row). Ties at the top-k / top-p
    boundary keep the lowest token ids, so exactly top_k tokens survive. min-p keeps the
    tokens whose probability is at least min_p times the most likely one's, before top-k and
    top-p (vLLM's order; llama.cpp's sampler chain orders them otherwise).
    """
    logits = logits.astype(jnp.float32)
    nd = logits.ndim
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = _per_row(temperature == 0, nd)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    p = jax.nn.softmax(logits / _per_row(safe_t, nd), axis=-1)
    if min_p is not None:
        # Only zeroes: the renormalisations below (top-k's, and the last) restore the mass,
        # and rows with min_p = 0 keep every token (p >= 0), bit for bit. Skipped (two passes
        # over the vocabulary) when no row sets it.
        min_p = jnp.asarray(min_p, jnp.float32)

        def floor(p):
            return jnp.where(p >= _per_row(min_p, nd) * p.max(-1, keepdims=True), p, 0.0)
        p = jax.lax.cond(jnp.any(min_p > 0), floor, lambda p: p, p)

    top_k = jnp.broadcast_to(_per_row(jnp.asarray(top_k, jnp.int32), nd - 1), logits.shape[:-1])
    top_p = jnp.broadcast_to(_per_row(jnp.asarray(top_p, jnp.float32), nd - 1), logits.shape[:-1])
    # The sort is the expensive part (V log V per position, and V is ~50k-150k); skip it when no
    # row truncates, the common case.
    any_truncation = jnp.any(((top_k > 0) & (top_k < p.shape[-1])) | (top_p < 1.0))
    p = jax.lax.cond(any_truncation, _truncate, lambda p, *_: p, p, top_k, top_p)
    p = p / p.sum(-1, keepdims=True)

    # Greedy rows' one-hot needs an argmax over the vocabulary (1.6 ms for 7 rows of 152k on
    # the dev VM): only when some row is greedy.
    def one_hot(p):
        hot = jax.nn.one_hot(top1(logits), logits.shape[-1], dtype=jnp.float32)
        return jnp.where(greedy, hot, p)
    return jax.lax.cond(jnp.any(temperature == 0), one_hot, lambda p: p, p)


def _block_width(v: int) -> int:
    """Tokens per block of the two-stage sampler: the power of two at or above sqrt(V), so
    both stages draw about sqrt(V) variates (512 for a 152k vocabulary, 297 blocks)."""
    return 1 << max(0, (v - 1).bit_length() + 1) // 2


def sample(probs: Float[Array, "B V"], keys: Key[Array, " B"]) -> Int[Array, " B"]:
    """One token per row, exactly from p, by Gumbel-max in two stages: a block of consecutive
    tokens with probability its mass, then a token of that block with probability its share
    of it (the product is p_i / sum p). argmax(log w + Gumbel) is an exact sample of w.

    Gumbel-max over the whole vocabulary drew V variates and took three logs of each: 37 ms
    per draft step for 7 rows of a 152k vocabulary on one core of the dev VM, more than the
    rest of the step's sampling; two stages draw ~2 sqrt(V) (1.2 ms for those rows). Unlike a CDF
    search, each stage's error is relative to the weights it compares (no cumulative sum),
    so tiny probabilities keep their relative accuracy.

    `probs` need not be normalised (the argmax is invariant to scaling), which lets verification
    pass the residual max(0, p - q) as is. Zero-probability tokens (and blocks) score -inf and
    can never win.
    """
    B, V = probs.shape
    width = _block_width(V)
    n = -(-V // width)
    p = jnp.pad(probs.astype(jnp.float32), ((0, 0), (0, n * width - V))).reshape(B, n, width)
    mass = p.sum(-1)  # [B, n]

    def gumbel_max(key, w):
        g = jax.random.gumbel(key, w.shape, jnp.float32)
        logw = jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), -jnp.inf)
        return jnp.argmax(logw + g)

    def one(key, blocks, m):
        k_block, k_token = jax.random.split(key)
        b = gumbel_max(k_block, m)
        return b * width + gumbel_max(k_token, blocks[b])

    return jax.vmap(one)(keys, p, mass).astype(jnp.int32)


def next_token(
    logits: Float[Array, "B V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    keys: Key[Array, " B"],
    min_p: Float[Array, " B"] | None = None,
) -> Int[Array, " B"]:
    """The AR step: greedy rows take argmax of the logits, other rows sample from process_probs."""
    temperature = jnp.asarray(temperature)
    greedy = top1(logits)

    def sampled(_):
        drawn = sample(process_probs(logits, temperature, top_k, top_p, min_p), keys)
        return jnp.where(temperature == 0, greedy, drawn)

    # An all-greedy batch skips the vocabulary-wide softmax and Gumbel noise (~2 ms per step
    # for a 49k vocabulary on this CPU).
    return jax.lax.cond(jnp.all(temperature == 0), lambda _: greedy, sampled, None)


def saguaro_rescale(
    q: Float[Array, "*S V"],
    num_top: int | Int[Array, " B"],
    c: float | Float[Array, ""] | Float[Array, " B"],
    fmax: int | None = None,
) -> Float[Array, "*S V"]:
    """Saguaro sampling: scale the top-`num_top` probabilities of q by C in (0, 1], renormalise.

    Lower C moves draft mass off the tokens the speculation cache forks on, so after a rejection
    the residual max(0, p - q') concentrates on them (higher hit rate). Lossless as long as the
    verifier is given this q' - the distribution the speculated token was actually drawn from.
    "Top" is the order (probability desc, index asc), the order `lax.top_k` gives the fork, so
    ties at the boundary scale exactly num_top tokens. num_top and C may be per row ([B], q's
    leading axis), C also one scalar array for all rows (SSD traces it as an argument, so a new
    C needs no recompile); a per-row num_top needs the static bound `fmax` >= every entry. C = 1
    and num_top = 0 are the identity.
    """
    q = q.astype(jnp.float32)
    V = q.shape[-1]
    if isinstance(c, (int, float)) and c == 1:  # a static C = 1 (SSD's cfg.c): no top-k pass
        return q
    if isinstance(num_top, int):
        num_top = min(num_top, V)
        if num_top <= 0:
            return q
        # Ties -> lowest index first, like argmax. The barrier keeps XLA:CPU's top-k: its
        # indices sliced at an offset compiled to a full sort of the vocabulary (368 against
        # 4 ms for [1, 7, 151936] on one Zen 1 vCPU).
        top_idx = jax.lax.optimization_barrier(jax.lax.top_k(q, num_top)[1])
        is_top = _ranked_at_or_above(q, top_idx[..., -1:])
    else:
        if fmax is None:
            raise ValueError("a per-row num_top needs fmax, a static bound on its entries")
        fmax = min(fmax, V)
        _, top_idx = jax.lax.top_k(q, fmax)
        last = _per_row(jnp.clip(num_top - 1, 0, fmax - 1), q.ndim)
        is_top = _ranked_at_or_above(q, jnp.take_along_axis(
            top_idx, jnp.broadcast_to(last, q.shape[:-1] + (1,)), axis=-1))
        is_top &= _per_row(num_top > 0, q.ndim)
    c = jnp.asarray(c, jnp.float32)
    c = c if c.ndim == 0 else _per_row(c, q.ndim)
    q = jnp.where(is_top, q * c, q)
    return q / q.sum(-1, keepdims=True)
