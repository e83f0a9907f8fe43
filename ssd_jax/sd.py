"""Ordinary speculative decoding (SD): the draft proposes K tokens, the target verifies K+1.

One round, per row with committed length L and last emitted token r at position L:
  draft:  feed [prev, r] at [L-1, L] (prev is the token at L-1; re-feeding it is harmless when it
          is already in the draft cache and necessary after a full acceptance, where the last
          draft token s_K was never fed), then K-1 single-token steps -> s_1..s_K and q_1..q_K;
  target: score [r, s_1..s_K] at L..L+K in one forward (causal chain mask) -> p_0..p_K;
  verify: k accepted, t* emitted (verify.py); the row advances by k+1.
All K+1 target K/V are committed at L each round and the length advances by k+1: the rejected
slots lie beyond the new length and are overwritten next round (hence K+1 slots of slack).
Everything stays on device; the host reads emitted tokens a chunk of rounds at a time.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.batch import Batch
from ssd_jax.metrics import RunMetrics
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, commit
from ssd_jax.runner import ModelRunner, RowSampling
from ssd_jax.sampling import process_probs, sample
from ssd_jax.verify import verify, verify_greedy

# Key streams per row: draft sampling and verification draw independent randomness, each
# indexed by position so a row's samples do not depend on its batch neighbours.
DRAFT_STREAM, VERIFY_STREAM = 11, 12


class SpecState(NamedTuple):
    """Device-side state of a speculative batch between rounds.

    prev: token at position lengths-1 (in the target cache). last: the emitted token r at
    position `lengths`, in neither cache yet. generated: tokens emitted so far (incl. r).
    done: a stop token was emitted or the budget reached; the row's length is frozen.
    """

    prev: Int[Array, " B"]
    last: Int[Array, " B"]
    lengths: Int[Array, " B"]
    generated: Int[Array, " B"]
    done: Bool[Array, " B"]


def stream_keys(sampling: RowSampling, stream: int, positions: Int[Array, " B"]):
    return jax.vmap(lambda k, p: jax.random.fold_in(jax.random.fold_in(k, stream), p))(
        sampling.keys, positions)


def draft_in(vocab, ids):
    return ids if vocab is None else vocab.draft_ids(ids)


def draft_space(vocab, logits: Float[Array, "*S Vd"]) -> Float[Array, "*S Vd"]:
    """The draft's own logits, its OOV slot masked (it names no target token). Proposals are
    drawn here, over the draft's vocabulary: the same distribution as over the target's (zero
    elsewhere), at a fraction of the softmax / top-k / Gumbel work (8k vs 49k for SmolLM2)."""
    if vocab is None:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) == vocab.oov, -jnp.inf, logits)


def target_ids(vocab, ids: Int[Array, "*S"]) -> Int[Array, "*S"]:
    return ids if vocab is None else vocab.target_ids(ids)


def target_probs(vocab, q: Float[Array, "*S Vd"] | None) -> Float[Array, "*S Vt"] | None:
    """q over the draft vocabulary -> the same distribution over the target's, which is what
    verification needs."""
    return q if vocab is None or q is None else vocab.target_probs(q)


def propose(logits: Float[Array, "B V"], sampling: RowSampling, positions: Int[Array, " B"],
            greedy_only: bool) -> tuple[Int[Array, " B"], Float[Array, "B V"] | None]:
    """Draft token and the exact distribution q it was drawn from (None when all greedy)."""
    if greedy_only:
        return jnp.argmax(logits, -1).astype(jnp.int32), None
    q = process_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    tok = sample(q, stream_keys(sampling, DRAFT_STREAM, positions))
    return tok, q


# `vocab` (a draft_vocab.VocabMap or None) is static: its index arrays become constants.
@partial(jax.jit, static_argnames=("graphdef", "vocab", "greedy_only"))
def draft_first(graphdef, params, vocab, state: SpecState, cache: KVCache,
                sampling: RowSampling, greedy_only: bool):
    B = state.last.shape[0]
    tokens = jnp.stack([state.prev, state.last], axis=1)
    positions = state.lengths[:, None] + jnp.arange(-1, 1)
    logits, kv = nnx.merge(graphdef, params)(draft_in(vocab, tokens), positions, cache,
                                             state.lengths - 1, causal_mask(B, 2),
                                             logit_index=jnp.ones((B, 1), jnp.int32))
    tok, q = propose(draft_space(vocab, logits[:, 0]), sampling, state.lengths + 1, greedy_only)
    return target_ids(vocab, tok), target_probs(vocab, q), kv


@partial(jax.jit, static_argnames=("graphdef", "vocab", "greedy_only"))
def draft_next(graphdef, params, vocab, tok: Int[Array, " B"], pos: Int[Array, " B"],
               cache: KVCache, sampling: RowSampling, greedy_only: bool):
    B = tok.shape[0]
    logits, kv = nnx.merge(graphdef, params)(draft_in(vocab, tok[:, None]), pos[:, None], cache,
                                             pos, jnp.ones((B, 1, 1), bool))
    nxt, q = propose(draft_space(vocab, logits[:, 0]), sampling, pos + 1, greedy_only)
    return target_ids(vocab, nxt), target_probs(vocab, q), kv


def emitted_tokens(drafts: Int[Array, "B K"], n: Int[Array, " B"], t: Int[Array, " B"]
                   ) -> Int[Array, "B K1"]:
    """s_1..s_n, t*, then -1 padding: the k+1 tokens a round emits."""
    K = drafts.shape[1]
    idx = jnp.arange(K + 1)[None]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return jnp.where(idx < n[:, None], padded, jnp.where(idx == n[:, None], t[:, None], -1))


def advance(state: SpecState, drafts: Int[Array, "B K"], n: Int[Array, " B"],
            t: Int[Array, " B"], stop_ids, max_new) -> tuple[SpecState, Int[Array, "B K1"]]:
    """Row bookkeeping after verification: emitted tokens, stop/budget, new length."""
    out = emitted_tokens(drafts, n, t)
    hit_stop = jnp.any((out[:, :, None] == stop_ids[:, None, :]) & (out[:, :, None] >= 0),
                       axis=(1, 2))
    generated = state.generated + n + 1
    done = state.done | hit_stop | (generated >= max_new)
    prev = jnp.where(n == 0, state.last,
                     jnp.take_along_axis(drafts, jnp.maximum(n - 1, 0)[:, None], 1)[:, 0])
    frozen = state.done
    new = SpecState(prev=jnp.where(frozen, state.prev, prev),
                    last=jnp.where(frozen, state.last, t),
                    lengths=jnp.where(frozen, state.lengths, state.lengths + n + 1),
                    generated=jnp.where(frozen, state.generated, generated),
                    done=done)
    return new, jnp.where(frozen[:, None], -1, out)


@partial(jax.jit, static_argnames=("graphdef", "greedy_only"))
def verify_round(graphdef, params, state: SpecState, drafts: Int[Array, "B K"],
                 q: Float[Array, "B K V"] | None, point_mass: Bool[Array, " B"], cache: KVCache,
                 sampling: RowSampling, stop_ids, max_new, greedy_only: bool):
    """Target forward over [r, s_1..s_K] and exact verification. Returns the new state, the
    emitted tokens [B, K+1] (-1 padded), the accepted counts n, the emitted token t and the
    K+1 new K/V. point_mass rows hold guesses not drawn from q (fast backup)."""
    B, K = drafts.shape
    tokens = jnp.concatenate([state.last[:, None], drafts], axis=1)
    positions = state.lengths[:, None] + jnp.arange(K + 1)
    logits, kv = nnx.merge(graphdef, params)(tokens, positions, cache, state.lengths,
                                             causal_mask(B, K + 1))
    if greedy_only:
        n, t = verify_greedy(logits, drafts)
    else:
        p = process_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        n, t = verify(p, drafts, q, point_mass, sampling.temperature == 0,
                      stream_keys(sampling, VERIFY_STREAM, state.lengths))
    new_state, out = advance(state, drafts, n, t, stop_ids, max_new)
    return new_state, out, n, t, kv


def draft_speculation(draft: ModelRunner, vocab, state: SpecState, cache: KVCache,
                      sampling: RowSampling, k: int, greedy_only: bool):
    """K draft tokens and their q, the draft cache updated through position L+K-1."""
    tok, q, kv = draft_first(draft.graphdef, draft.params, vocab, state, cache, sampling,
                             greedy_only)
    cache = commit(cache, kv, state.lengths - 1)
    toks, qs = [tok], [q]
    for i in range(1, k):
        pos = state.lengths + i
        tok, q, kv = draft_next(draft.graphdef, draft.params, vocab, tok, pos, cache, sampling,
                                greedy_only)
        cache = commit(cache, kv, pos)
        toks.append(tok)
        qs.append(q)
    drafts = jnp.stack(toks, axis=1)
    return drafts, (None if greedy_only else jnp.stack(qs, axis=1)), cache


def spec_prefill(target: ModelRunner, draft: ModelRunner, vocab, batch: Batch,
                 target_cache: KVCache, draft_cache: KVCache, to_draft=lambda x: x):
    """Prefill both caches; the target samples the first token r. `to_draft` moves the
    prompt to the draft's devices (explicitly: see Batch.place)."""
    ar_state, target_cache = target.prefill(batch.tokens, batch.prompt_len, target_cache,
                                            batch.sampling, batch.stop_ids, batch.max_new)
    draft_cache = draft.fill(draft_in(vocab, to_draft(batch.tokens)), draft_cache)
    prev = jnp.take_along_axis(batch.tokens, (batch.prompt_len - 1)[:, None], 1)[:, 0]
    state = SpecState(prev=prev, last=ar_state.tokens, lengths=ar_state.lengths,
                      generated=ar_state.generated, done=ar_state.done)
    return state, target_cache, draft_cache


def sd_loop(target: ModelRunner, draft: ModelRunner, vocab, batch: Batch,
            target_cache: KVCache, draft_cache: KVCache, k: int, metrics: RunMetrics,
            sync_every: int) -> Iterator[list[list[int]]]:
    """Yields each real row's newly emitted tokens per chunk of rounds."""
    t0 = time.perf_counter()
    state, target_cache, draft_cache = spec_prefill(target, draft, vocab, batch, target_cache,
                                                    draft_cache)
    # Built from a state array, so it lives on the target's devices (a fresh jnp.zeros would
    # sit on device 0 and be copied to the mesh every round).
    no_point_mass = state.done & False
    first = np.asarray(state.last)
    metrics.ttft_s = time.perf_counter() - t0
    yield [[int(t)] for t in first[:batch.n]]
    hist = np.zeros(k + 1, np.int64)
    t1 = time.perf_counter()
    while True:
        rounds = []
        for _ in range(sync_every):
            ts = time.perf_counter()
            drafts, q, draft_cache = draft_speculation(draft, vocab, state, draft_cache,
                                                       batch.sampling, k, batch.greedy_only)
            if metrics.sync_phases:
                drafts.block_until_ready()
            tv = time.perf_counter()
            state_before = state
            state, out, n, _, kv = verify_round(
                target.graphdef, target.params, state, drafts, q, no_point_mass, target_cache,
                batch.sampling, batch.stop_ids, batch.max_new, batch.greedy_only)
            target_cache = commit(target_cache, kv, state_before.lengths)
            if metrics.sync_phases:
                n.block_until_ready()
                metrics.draft_s += tv - ts
                metrics.verify_s += time.perf_counter() - tv
            rounds.append((out, n, state_before.done))
        outs = np.stack([np.asarray(o)[:batch.n] for o, _, _ in rounds], axis=1)  # [n, R, K+1]
        for _, n, was_done in rounds:
            live = ~np.asarray(was_done)[:batch.n]
            np.add.at(hist, np.asarray(n)[:batch.n][live], 1)
        metrics.decode_steps += len(rounds)
        metrics.accept_hist = hist.tolist()
        metrics.decode_s = time.perf_counter() - t1
        yield [[int(t) for t in row.reshape(-1) if t >= 0] for row in outs]
        if np.asarray(state.done)[:batch.n].all():
            return
