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

NEG_INF = -1e30


class GluePrefix(NamedTuple):
    kv: KVCache  # per layer [B, K, Hkv, D]: r, s_1..s_{K-1} at L..L+K-1
    cand: Int[Array, "B K F"]  # fork candidates at glue positions 0..K-1 (target ids)
    ok: Bool[Array, " B"]


def fork_candidates(vocab, logits: Float[Array, "*S Vd"], exclude: Int[Array, "*S"] | None,
                    f: int) -> Int[Array, "*S F"]:
    """The top-f tokens (target ids) of the draft's logits, without `exclude` (the token the
    speculation itself continues with there: it is never a recovery token, see draft.py)."""
    g = vocab.proposable(logits)
    if exclude is not None:
        hit = jnp.arange(g.shape[-1]) == vocab.out_ids(exclude)[..., None]
        g = jnp.where(hit, NEG_INF, g)
    return vocab.target_ids(jax.lax.top_k(g, f)[1].astype(jnp.int32))


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
