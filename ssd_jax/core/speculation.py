"""Speculation basics shared by SD and SSD: the messages of a round, the draft's sampler and its
K-step decoder.

A speculation is K draft tokens per row with the exact distributions q they were drawn from
(verification needs q, not just the tokens), a point-mass flag for guesses drawn from no
distribution (the fast backup), and whether SSD's cache hit. The outcome of verifying it is
(n accepted, t emitted). Proposals are drawn over the draft's own vocabulary (`vocab`, a
draft_vocab.VocabMap or SameVocab) and named by target ids.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.core.rows import (DRAFT_STREAM, Requests, RowSampling, RowState, Seen, hold_stops,
                               row_keys)
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, commit
from ssd_jax.sampling import (add_bias, penalize, process_probs, sample, saguaro_rescale,
                               top1)


class Speculation(NamedTuple):
    """What the target verifies next: draft -> target."""

    tokens: Int[Array, "B K"]
    q: Float[Array, "B K V"] | None  # None when every row is greedy
    point_mass: Bool[Array, " B"]  # guesses from no distribution (verify.py's point-mass rule)
    hit: Bool[Array, " B"]  # SSD: the speculation came from the cache (statistics only)


class Outcome(NamedTuple):
    """What verification decided: target -> draft. n = -1: no round verified yet (start-up)."""

    n: Int[Array, " B"]
    t: Int[Array, " B"]


class Saguaro(NamedTuple):
    """Saguaro sampling for speculated tokens: token j of a speculation is verified at position
    j, where the next round's fork takes fan[:, j] candidates; their probability is scaled by c
    (sampling.saguaro_rescale). fmax bounds fan's entries (static)."""

    fan: Int[Array, "B K1"]
    c: float | Float[Array, ""]
    fmax: int


def propose(logits: Float[Array, "B N Vd"], req: Requests, positions: Int[Array, "B N"],
            vocab, greedy_only: bool, saguaro: tuple[Int[Array, " B"], Saguaro] | None = None
            ) -> tuple[Int[Array, "B N"], Float[Array, "B N Vd"] | None]:
    """Draft tokens (target ids) for N parallel positions per row and the q they were drawn
    from, over the draft vocabulary (vocab.target_probs maps it to the target's). `saguaro`:
    (per-row fork count, settings) to rescale q with."""
    logits = vocab.proposable(logits)
    if greedy_only:
        return vocab.target_ids(top1(logits)), None
    B, N, V = logits.shape
    s = req.sampling
    q = process_probs(logits, s.temperature, s.top_k, s.top_p, s.min_p)
    if saguaro is not None:
        num_top, sg = saguaro
        q = saguaro_rescale(q, num_top, sg.c, sg.fmax)
    keys = row_keys(RowSampling(*(jnp.repeat(x, N, axis=0) for x in s)), DRAFT_STREAM,
                    positions.reshape(-1))
    # Greedy rows in a mixed batch: process_probs gave a one-hot, so the sample is the argmax.
    tok = sample(q.reshape(B * N, V), keys).reshape(B, N)
    return vocab.target_ids(tok), q


def draft_decode(model, cfg, tokens: Int[Array, "B T"], start: Int[Array, " B"],
                 cache: KVCache, req: Requests, first: Int[Array, " B"],
                 saguaro: Saguaro | None = None, seen: Seen | None = None):
    """K = cfg.k draft tokens after `tokens` (fed at start..start+T-1, the cache valid below
    `start`), each from the logits of the newest token; `cfg` is the draft's static
    draft.DraftConfig (vocab, k, greedy_only). The new K/V ride in the attention's `extra` block
    (T + K - 1 positions from `start`) and are returned, not written: SD commits them, SSD's
    backup keeps them for the next glue (draft.py). Returns (drafts [B, K], q [B, K, Vd] | None,
    new K/V, the logits each draft came from [B, K, Vd], steered); unused outputs cost nothing
    (XLA drops them).

    Each draft is proposed from logits moved as the target's law is at its position (steer):
    `first` is the answer token number the first draft would be (its min_tokens mask), `seen`
    the rows' penalty counts (rows.Seen, target ids) when the batch carries them (the committed
    tokens and the drafts before each position counted). Any proposal is exact (verification
    reads q, which is drawn from these logits); these are accepted more often."""
    vocab, k, greedy_only = cfg.vocab, cfg.k, cfg.greedy_only
    B, T = tokens.shape
    x, extra = tokens, None
    pos = start[:, None] + jnp.arange(T)
    toks, qs, step_logits = [], [], []
    if seen is not None:
        counts, in_prompt = vocab.draft_columns(seen.counts), vocab.draft_columns(seen.in_prompt)
    for step in range(k):
        mask = causal_mask(B, T) if step == 0 else jnp.ones((B, 1, T + step), bool)
        logits, kv = model(vocab.draft_ids(x), pos, cache, start, mask, extra=extra,
                           logit_index=None if step else jnp.full((B, 1), T - 1, jnp.int32))
        nxt = pos[:, -1:] + 1
        steered = steer(logits, req, vocab, (first + step)[:, None],
                        None if seen is None else lambda: counts[:, None],
                        None if seen is None else in_prompt)
        x, q = propose(steered, req, nxt, vocab, greedy_only,
                       None if saguaro is None else (saguaro.fan[:, step], saguaro))
        if seen is not None:
            counts = counts.at[jnp.arange(B), vocab.out_ids(x[:, 0])].add(1)
        toks.append(x[:, 0])
        qs.append(None if q is None else q[:, 0])
        step_logits.append(steered[:, -1])
        extra = kv if extra is None else jax.tree.map(
            lambda a, b: jnp.concatenate([a, b], axis=1), extra, kv)
        pos = nxt
    return (jnp.stack(toks, 1), (None if greedy_only else jnp.stack(qs, 1)), extra,
            jnp.stack(step_logits, 1))


def steer(logits: Float[Array, "B S Vd"], req: Requests, vocab, number: Int[Array, "B S"],
          counts: Callable[[], Int[Array, "B S Vd"]] | None = None,
          in_prompt: Bool[Array, "B Vd"] | None = None) -> Float[Array, "B S Vd"]:
    """The draft's logits moved as the target's law is at the same positions
    (rows.target_logits), in the draft's columns: each row's logit bias, its penalties given the
    token counts there (`counts()`; None where the batch carries no counts), and its stop ids
    at -inf where the position would emit answer token `number` (1-based) <= min_tokens. So the
    draft proposes, and SSD forks, as the target will decide: a banned token or a held-back
    stop is no longer proposed only to be rejected. Each part runs only when some row asks for
    it (a live batch carries settings that most requests leave off). Exact either way:
    verification reads q, drawn from what this returns."""
    s = req.sampling
    # A bias or a stop id the draft cannot name lands on its OOV column, never proposed.
    logits = jax.lax.cond(jnp.any(s.bias != 0),
                          lambda x: add_bias(x, vocab.out_ids(s.bias_ids), s.bias),
                          lambda x: x, logits.astype(jnp.float32))
    if counts is not None:
        on = (s.presence != 0) | (s.frequency != 0) | (s.repetition != 1)
        logits = jax.lax.cond(
            jnp.any(on), lambda x: penalize(x, counts(), in_prompt, s.presence, s.frequency,
                                            s.repetition), lambda x: x, logits)
    stop_cols = jnp.where(req.stop_ids >= 0, vocab.out_ids(jnp.maximum(req.stop_ids, 0)), -1)
    return jax.lax.cond(jnp.any(number <= req.min_new[:, None]),
                        lambda x: hold_stops(x, stop_cols, number, req.min_new),
                        lambda x: x, logits)


@partial(jax.jit, static_argnames=("cfg",))
def _sd_draft(cfg, params, rows: RowState, cache: KVCache, req: Requests
              ) -> tuple[Speculation, KVCache]:
    # [prev, r] at [L-1, L]: re-feeding prev is harmless when it is already in the cache and
    # necessary after a full acceptance, where the last draft token s_K was never fed.
    tokens = jnp.stack([rows.prev, rows.last], axis=1)
    drafts, q, kv, _ = draft_decode(cfg.graphdef.merge(params), cfg, tokens, rows.lengths - 1,
                                    cache, req, rows.generated + 1, seen=rows.seen)
    no = jnp.zeros_like(rows.done)
    return Speculation(drafts, None if q is None else cfg.vocab.target_probs(q), no, ~no), kv


def sd_speculation(draft, cfg, rows: RowState, cache: KVCache, req: Requests
                   ) -> tuple[Speculation, KVCache]:
    """SD's drafting with `draft` (a ModelRunner) and its static draft.DraftConfig: K tokens
    after r, the draft cache committed through position L+K-1."""
    spec, kv = _sd_draft(cfg, draft.leaves, rows, cache, req)
    return spec, commit(cache, kv, rows.lengths - 1)
