"""What the decoding of a speculation already knows of the next round's glue.

SSD's glue scores [r, s_1..s_K] at L..L+K while the target verifies them, for two things: the
K/V of those positions (committed: the accepted part is the next round's prefix) and the
draft's distributions g_0..g_K there, whose top tokens are the fork candidates. But a
speculation that came out of the draft (a tree branch on a cache hit, or the neural backup)
was decoded by feeding r, s_1..s_{K-1} at exactly those positions after exactly that prefix,
and each of those steps produced g_j while proposing s_{j+1}. Kept, they leave the glue only
s_K to feed: one token instead of K+1, on the draft's critical path every round.

GluePrefix is that knowledge per row: the K/V of r, s_1..s_{K-1}, the fork candidates at
j = 0..K-1 (top F of g_j without s_{j+1}, target ids), and `ok` (False for fast-backup
guesses and the first speculation, which no draft decoding produced). The recomputed K/V can
differ from a glue pass's in the last bits (other shapes, other reduction order); nothing
exact depends on them: verification uses the q each token was drawn from, never g.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.models.transformer import KVCache
from ssd_jax.sampling import top1

NEG_INF = -1e30


class GluePrefix(NamedTuple):
    kv: KVCache  # per layer [B, K, Hkv, D]: r, s_1..s_{K-1} at L..L+K-1
    cand: Int[Array, "B K F"]  # fork candidates at glue positions 0..K-1 (target ids)
    ok: Bool[Array, " B"]


def top_tokens(logits: Float[Array, "*S V"], n: int) -> Int[Array, "*S N"]:
    """The indices of the n largest logits, ranked (ties -> lowest index first). The barrier
    keeps XLA:CPU's top-k custom call: a top-k whose indices are then sliced at an offset was
    compiled as a full sort of the vocabulary (260 against 1.4 ms for 6 rows of 152k)."""
    return jax.lax.optimization_barrier(jax.lax.top_k(logits, n)[1].astype(jnp.int32))


def fork_candidates(vocab, logits: Float[Array, "*S Vd"], exclude: Int[Array, "*S"] | None,
                    f: int) -> Int[Array, "*S F"]:
    """The top-f tokens (target ids) of the draft's logits, without `exclude` (the token the
    speculation itself continues with there: it is never a recovery token, see draft.py)."""
    g = vocab.proposable(logits)
    if exclude is None:
        return vocab.target_ids(top_tokens(g, f))
    out = vocab.out_ids(exclude)[..., None]
    if f + 1 > g.shape[-1]:  # a vocabulary this small: mask the excluded token instead
        g = jnp.where(jnp.arange(g.shape[-1]) == out, NEG_INF, g)
        return vocab.target_ids(top_tokens(g, f))
    # The top f + 1 without `exclude` if it is among them, else the top f: one top-k, no
    # vocabulary-wide mask.
    top = top_tokens(g, f + 1)
    past = jnp.cumsum(top == out, axis=-1)[..., :f] > 0
    return vocab.target_ids(jnp.where(past, top[..., 1:], top[..., :f]))


def greedy_with_candidates(vocab, logits: Float[Array, "*S Vd"], f: int
                           ) -> tuple[Int[Array, "*S"], Int[Array, "*S F"]]:
    """A greedy proposal and its fork candidates from one top-k: the argmax (speculation.
    propose's greedy token) and the next f (fork_candidates without it), target ids."""
    g = vocab.proposable(logits)
    if f + 1 > g.shape[-1]:
        x = vocab.target_ids(top1(g))
        return x, fork_candidates(vocab, logits, x, f)
    top = vocab.target_ids(top_tokens(g, f + 1))
    return top[..., 0], top[..., 1:]


def no_prefix(config, batch: int, k: int, f: int) -> GluePrefix:
    """The prefix of rows whose speculation no draft decoding produced."""
    shape = (batch, k, config.num_kv_heads, config.head_dim)
    z = tuple(jnp.zeros(shape, jnp.dtype(config.dtype)) for _ in range(config.num_layers))
    return GluePrefix(KVCache(z, z), jnp.zeros((batch, k, f), jnp.int32),
                      jnp.zeros((batch,), bool))


def pick(use: Bool[Array, " B"], a: GluePrefix, b: GluePrefix) -> GluePrefix:
    """Row-wise a where `use`, else b."""
    return jax.tree.map(lambda x, y: jnp.where(use.reshape((-1,) + (1,) * (x.ndim - 1)), x, y),
                        a, b)
