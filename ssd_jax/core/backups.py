"""Backup speculators: what SSD proposes for a row whose outcome the speculation cache missed.

Strategies passed to the draft side in its static DraftConfig (hashable, no state):
  NeuralBackup: the draft decodes K tokens after r (good tokens, at the draft's latency);
  FastBackup:   n-gram / prompt lookup over the row's own tokens (almost free; guesses come
                from no distribution, so verification treats them as point-mass proposals,
                verify.py, which keeps SSD lossless).
Both return (tokens [B, K], q [B, K, Vd] | None, point_mass [B], glue prefix | None) for the
rows that missed; the caller keeps the cached branch for the rows that hit. The neural backup's
decoding is also the next glue's prefix (glue.py); n-gram guesses have none.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ssd_jax.core.glue import GluePrefix, fork_candidates, no_prefix
from ssd_jax.core.speculation import Saguaro, draft_decode


@dataclass(frozen=True)
class NeuralBackup:
    name: str = "neural"

    def propose(self, model, cfg, ds, req, hit: Bool[Array, " B"]):
        """K draft tokens after r at L (the cache is valid through L-1 after the glue commit),
        computed only when some live row missed."""
        rows = ds.rows
        B, V = rows.last.shape[0], cfg.vocab.draft_size

        def run(_):
            toks, q, kv, logits = draft_decode(model, cfg, rows.last[:, None], rows.lengths,
                                               ds.cache, req, rows.generated + 1,
                                               Saguaro(ds.fan.primary, cfg.c, cfg.fmax),
                                               seen=rows.seen)
            cand = fork_candidates(cfg.vocab, logits, toks, cfg.fmax)
            return toks, q, GluePrefix(kv, cand, jnp.ones((B,), bool))

        def skip(_):
            return (jnp.zeros((B, cfg.k), jnp.int32),
                    None if cfg.greedy_only else jnp.zeros((B, cfg.k, V), jnp.float32),
                    no_prefix(model.config, B, cfg.k, cfg.fmax))

        # The common all-hit round skips the backup. Finished and padding rows' speculations
        # are discarded, so their misses must not put K draft steps on every round's path.
        toks, q, prefix = jax.lax.cond(jnp.all(hit | rows.done), skip, run, None)
        return toks, q, jnp.zeros((B,), bool), prefix


@dataclass(frozen=True)
class FastBackup:
    name: str = "fast"

    def propose(self, model, cfg, ds, req, hit: Bool[Array, " B"]):
        guess = ngram_propose(ds.history, ds.rows.lengths + 1, cfg.k)
        q = None if cfg.greedy_only else jnp.zeros(guess.shape + (cfg.vocab.draft_size,))
        return guess, q, ~hit, None


BACKUPS = {"neural": NeuralBackup(), "fast": FastBackup()}


def ngram_propose(history: Int[Array, "B S"], length: Int[Array, " B"], k: int,
                  max_n: int = 3) -> Int[Array, "B K"]:
    """K guessed continuations of history[b, :length[b]] per row.

    Tries n = max_n..1: the latest position p with history[p-n+1..p] equal to the last n tokens
    (p < length-1) proposes history[p+1..p+K]; positions at or past length-1 repeat the
    last known token. With no match at all, the last token is repeated.
    """
    B, S = history.shape
    idx = jnp.arange(S)
    last_pos = length - 1  # position of the newest token

    def match_end(n):
        # ends[b, p]: history[b, p-i] == history[b, last-i] for i < n, and p < last.
        ok = idx[None, :] < last_pos[:, None]
        ok &= idx[None, :] >= n - 1
        for i in range(n):
            tail = jnp.take_along_axis(history, jnp.maximum(last_pos - i, 0)[:, None], 1)
            shifted = jnp.roll(history, i, axis=1)  # shifted[p] = history[p-i]
            ok &= shifted == tail
        return jnp.max(jnp.where(ok, idx[None, :], -1), axis=1)  # the latest match

    best = jnp.full((B,), -1)
    for n in range(max_n, 0, -1):
        best = jnp.where(best >= 0, best, match_end(n))
    start = jnp.where(best >= 0, best + 1, last_pos)
    pos = jnp.minimum(start[:, None] + jnp.arange(k)[None, :], last_pos[:, None])
    return jnp.take_along_axis(history, pos, axis=1).astype(jnp.int32)


def append_tokens(history: Int[Array, "B S"], length: Int[Array, " B"],
                  tokens: Int[Array, "B T"], count: Int[Array, " B"]) -> Int[Array, "B S"]:
    """Write tokens[b, :count[b]] at history[b, length[b]:]; entries past count are dropped."""
    B, T = tokens.shape
    S = history.shape[1]
    pos = length[:, None] + jnp.arange(T)[None, :]
    keep = jnp.arange(T)[None, :] < count[:, None]
    pos = jnp.where(keep, pos, S)  # out of range: dropped by the scatter
    return history.at[jnp.arange(B)[:, None], pos].set(tokens, mode="drop")
