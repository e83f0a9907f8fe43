"""The SSD draft side, jitted on the draft mesh: glue decode, fork, tree decode, speculation
cache, and selection of the next speculation (cache hit, or a backup on a miss).

While the target verifies [r, s_1..s_K] at positions L..L+K, the draft:
  glue:  scores the same K+1 tokens -> g_0..g_K, g_j = draft's next-token distribution after
         r, s_1..s_j (its K/V is committed to the draft cache afterwards, by the caller);
  fork:  at glue position j takes the top-F_j tokens x, excluding s_{j+1} for j < K (a rejected
         token is never the recovery token: at T=0 it differs from argmax p, at T>0 the
         residual max(0, p - q') is zero there). Branch (j, x) is the outcome "j accepted, the
         target emitted x";
  tree:  decodes K tokens for all M branches at once. Branch (j, x) sits at positions L+j+1..
         and sees the committed prefix (< L), glue tokens 0..j and its own tokens, never its
         siblings. Glue and branch K/V stay in the attention's new-token block (`extra`), so the
         cache is only read inside this program (the XLA:CPU cache-copy trap) and nothing
         speculative is ever written to it.
Every speculated token is drawn from q' = Saguaro-rescaled process_probs(draft logits) and q'
is kept, because verification must use the exact distribution a token came from.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.backup import ngram_propose
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache
from ssd_jax.runner import RowSampling
from ssd_jax.sampling import process_probs, sample, saguaro_rescale
from ssd_jax.sd import (DRAFT_STREAM, SpecState, draft_in, draft_space, stream_keys, target_ids,
                        target_probs)

NEG_INF = -1e30


class SpecCache(NamedTuple):
    """Speculations for every pre-speculated outcome of the round being verified.

    branch_j [B, M]: accept length the branch assumes (-1: empty slot, never hit);
    fork_tok [B, M]: the recovery/bonus token it assumes; tokens [B, M, K]: its speculation;
    q [B, M, K, Vd]: the distributions those tokens were drawn from, over the draft's vocabulary
    (None when all greedy);
    cand [B, K+1, Fmax]: glue candidates by rank, for the hit-rate-vs-F statistics.
    """

    branch_j: Int[Array, "B M"]
    fork_tok: Int[Array, "B M"]
    tokens: Int[Array, "B M K"]
    q: Float[Array, "B M K Vd"] | None
    cand: Int[Array, "B K1 F"]


def draft_vocab_size(vocab, target_vocab_size: int) -> int:
    """The size of the space the draft proposes in (SpecCache.q's last axis, the fork's)."""
    return target_vocab_size if vocab is None else vocab.draft_size


def empty_cache(batch: int, m: int, k: int, vocab_size: int | None) -> SpecCache:
    """The cache before the first round: no branch can hit. vocab_size (the draft's, see
    draft_vocab_size) is None when all greedy."""
    q = None if vocab_size is None else jnp.zeros((batch, m, k, vocab_size), jnp.float32)
    return SpecCache(jnp.full((batch, m), -1, jnp.int32), jnp.full((batch, m), -1, jnp.int32),
                     jnp.zeros((batch, m, k), jnp.int32), q,
                     jnp.full((batch, k + 1, 1), -1, jnp.int32))


def propose_tokens(logits: Float[Array, "B N Vd"], sampling: RowSampling,
                   positions: Int[Array, "B N"], num_top: Int[Array, " B"], c, fmax: int,
                   greedy_only: bool, vocab=None):
    """Draft tokens (target ids) for N parallel positions per row and the q' they were drawn
    from, over the draft vocabulary (`target_probs` maps it to the target's)."""
    logits = draft_space(vocab, logits)
    if greedy_only:
        return target_ids(vocab, jnp.argmax(logits, -1).astype(jnp.int32)), None
    B, N, V = logits.shape
    q = process_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    q = saguaro_rescale(q, num_top, c, fmax)  # num_top: next round's fork count here
    keys = stream_keys(
        RowSampling(*(jnp.repeat(x, N, axis=0) for x in sampling)), DRAFT_STREAM,
        positions.reshape(-1))
    tok = sample(q.reshape(B * N, V), keys).reshape(B, N)
    # Greedy rows in a mixed batch: process_probs gave a one-hot, so the sample is the argmax.
    return target_ids(vocab, tok), q


def branch_layout(fan: Int[Array, "B K1"], m: int) -> tuple[Int[Array, "B M"], Int[Array, "B M"]]:
    """Branch slot -> (glue position j, rank among that position's candidates)."""
    ends = jnp.cumsum(fan, axis=-1)  # [B, K+1]
    slot = jnp.arange(m)
    j = jnp.sum(ends[:, None, :] <= slot[None, :, None], axis=-1)  # [B, M]
    j = jnp.minimum(j, fan.shape[1] - 1)
    start = jnp.take_along_axis(ends - fan, j, axis=1)
    return j.astype(jnp.int32), (slot[None, :] - start).astype(jnp.int32)


def tree_mask(branch_j: Int[Array, "B M"], k: int, step: int) -> Bool[Array, "B M U"]:
    """Step `step` (0-based) of the tree decode: keys are glue (K+1) then the branch tokens of
    steps 0..step, M per step. A branch sees glue 0..j and its own column only."""
    B, M = branch_j.shape
    glue = jnp.arange(k + 1)[None, None, :] <= branch_j[:, :, None]
    own = jnp.tile(jnp.eye(M, dtype=bool), (1, step + 1))
    return jnp.concatenate([glue, jnp.broadcast_to(own, (B, M, M * (step + 1)))], axis=-1)


@partial(jax.jit, static_argnames=("graphdef", "vocab", "budget", "greedy_only"))
def build_cache(graphdef, params, vocab, state: SpecState, spec: Int[Array, "B K"],
                cache: KVCache, sampling: RowSampling, fan: Int[Array, "B K1"], c,
                budget: int, greedy_only: bool) -> tuple[SpecCache, KVCache]:
    """Glue decode + fork + tree decode. Returns the speculation cache and the glue K/V, which
    the caller commits at state.lengths (the glue tokens are r, s_1..s_K at L..L+K)."""
    model = nnx.merge(graphdef, params)
    B, K = spec.shape
    M, L = budget, state.lengths
    tokens = jnp.concatenate([state.last[:, None], spec], axis=1)
    glue_logits, glue_kv = model(draft_in(vocab, tokens), L[:, None] + jnp.arange(K + 1), cache,
                                 L, causal_mask(B, K + 1))
    g = draft_space(vocab, glue_logits)  # [B, K+1, Vd]

    # Fork: exclude s_{j+1} at j < K, rank the rest by the draft's logits (in the draft's
    # vocabulary; candidates are mapped to target ids).
    V = g.shape[-1]
    excluded = jnp.concatenate([draft_in(vocab, spec), jnp.full((B, 1), -1, spec.dtype)], axis=1)
    g_fork = jnp.where(jnp.arange(V)[None, None, :] == excluded[:, :, None], NEG_INF, g)
    fmax = min(M, V)
    cand = target_ids(vocab, jax.lax.top_k(g_fork, fmax)[1].astype(jnp.int32))  # [B, K+1, F]
    branch_j, rank = branch_layout(fan, M)
    fork_tok = jnp.take_along_axis(cand.reshape(B, -1), branch_j * fmax + rank, axis=1)

    # Tree decode: K steps for all M branches; glue and earlier branch K/V ride in `extra`.
    x, pos, extra = fork_tok, L[:, None] + branch_j + 1, glue_kv
    toks, qs = [], []
    for step in range(K):
        logits, kv = model(draft_in(vocab, x), pos, cache, L, tree_mask(branch_j, K, step),
                           extra=extra)
        # Token `step` of a branch is verified at position `step` next round, where the
        # fork uses fan[:, step] candidates: that is the Saguaro top set.
        x, q = propose_tokens(logits, sampling, pos + 1, fan[:, step], c, fmax,
                              greedy_only, vocab)
        toks.append(x)
        qs.append(q)
        extra = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), extra, kv)
        pos = pos + 1
    q = None if greedy_only else jnp.stack(qs, axis=2)
    return SpecCache(branch_j, fork_tok, jnp.stack(toks, axis=2), q, cand), glue_kv


def neural_backup(model, vocab, state: SpecState, cache: KVCache, sampling: RowSampling,
                  fan: Int[Array, "B K1"], c, k: int, fmax: int, greedy_only: bool):
    """The draft decodes K tokens after r at L (cache valid through L-1 after the glue
    commit), keeping its own K/V in `extra` rather than the cache."""
    B = state.last.shape[0]
    x, pos, extra = state.last[:, None], state.lengths[:, None], None
    toks, qs = [], []
    for step in range(k):
        mask = jnp.ones((B, 1, step + 1), bool)
        logits, kv = model(draft_in(vocab, x), pos, cache, state.lengths, mask, extra=extra)
        x, q = propose_tokens(logits, sampling, pos + 1, fan[:, step], c, fmax,
                              greedy_only, vocab)
        toks.append(x[:, 0])
        qs.append(None if q is None else q[:, 0])
        extra = kv if extra is None else jax.tree.map(
            lambda a, b: jnp.concatenate([a, b], axis=1), extra, kv)
        pos = pos + 1
    return jnp.stack(toks, 1), (None if greedy_only else jnp.stack(qs, 1))


@partial(jax.jit,
         static_argnames=("graphdef", "vocab", "backup", "greedy_only", "k", "fmax"))
def select(graphdef, params, vocab, state: SpecState, spec_cache: SpecCache,
           n: Int[Array, " B"], t: Int[Array, " B"], history: Int[Array, "B S"],
           cache: KVCache, sampling: RowSampling, fan: Int[Array, "B K1"], c, backup: str,
           greedy_only: bool, k: int, fmax: int):
    """Next speculation per row: the cached branch for outcome (n, t) on a hit, else the
    backup. `state` is already advanced (r = t at the new length). Returns tokens [B, K],
    q [B, K, V] | None (over the target vocabulary; the cache keeps the draft's), point_mass [B]
    (fast-backup guesses), hit [B], rank [B] (rank of t among the glue candidates at n, Fmax
    when absent: feeds the fan-out's power-law fit)."""
    match = ((spec_cache.branch_j == n[:, None]) & (spec_cache.fork_tok == t[:, None])
             & (spec_cache.branch_j >= 0))
    hit = jnp.any(match, axis=1)
    m = jnp.argmax(match, axis=1)
    hit_tokens = jnp.take_along_axis(spec_cache.tokens, m[:, None, None], axis=1)[:, 0]
    cand_n = jnp.take_along_axis(spec_cache.cand, jnp.clip(n, 0)[:, None, None], axis=1)[:, 0]
    found = cand_n == t[:, None]
    rank = jnp.where(jnp.any(found, 1), jnp.argmax(found, 1), fmax)
    B = n.shape[0]
    if backup == "fast":
        guess = ngram_propose(history, state.lengths + 1, k)
        tokens = jnp.where(hit[:, None], hit_tokens, guess)
        point_mass = ~hit
        q = None
        if not greedy_only:
            hit_q = jnp.take_along_axis(spec_cache.q, m[:, None, None, None], axis=1)[:, 0]
            q = jnp.where(hit[:, None, None], hit_q, 0.0)
        return tokens, target_probs(vocab, q), point_mass, hit, rank
    model = nnx.merge(graphdef, params)

    def run_backup(_):
        return neural_backup(model, vocab, state, cache, sampling, fan, c, k, fmax, greedy_only)

    def skip(_):
        V = None if greedy_only else spec_cache.q.shape[-1]
        return (jnp.zeros((B, k), jnp.int32),
                None if greedy_only else jnp.zeros((B, k, V), jnp.float32))

    # The backup is computed only when some live row missed (the common all-hit round skips
    # it). Finished and padding rows' speculations are discarded, so their misses must not
    # put the K-step backup on every round's critical path.
    b_tokens, b_q = jax.lax.cond(jnp.all(hit | state.done), skip, run_backup, None)
    tokens = jnp.where(hit[:, None], hit_tokens, b_tokens)
    q = None
    if not greedy_only:
        hit_q = jnp.take_along_axis(spec_cache.q, m[:, None, None, None], axis=1)[:, 0]
        q = jnp.where(hit[:, None, None], hit_q, b_q)
    return tokens, target_probs(vocab, q), jnp.zeros((B,), bool), hit, rank
