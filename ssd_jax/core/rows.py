"""The rows of a decode batch: what each request asked for, the state every mode advances, the
key scheme, and the bookkeeping after a step or a round.

AR is the K = 0 case of a speculative round: feed r, emit one token. So one state type and one
`advance` serve AR, SD and SSD, and the target and the draft side of SSD advance their copies of
the rows with the same function on the same outcome, agreeing on lengths and on when every row
is done without any other message.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from ssd_jax.sampling import add_bias, penalize

# Key streams per row: target sampling, draft proposals and verification draw independent
# randomness, each indexed by position so a row's samples do not depend on its neighbours.
SAMPLE_STREAM, DRAFT_STREAM, VERIFY_STREAM = 10, 11, 12


class RowSampling(NamedTuple):
    """Per-row sampling settings as device arrays, so one compiled step serves any mix."""

    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]
    keys: Key[Array, " B"]  # one base key per request; see row_keys
    # logit_bias as W (id, value) pairs per row, padded with (0, 0.0): sampling.add_bias.
    bias_ids: Int[Array, "B W"]
    bias: Float[Array, "B W"]
    # SamplingParams' presence / frequency / repetition penalties (0, 0, 1: off).
    presence: Float[Array, " B"]
    frequency: Float[Array, " B"]
    repetition: Float[Array, " B"]
    min_p: Float[Array, " B"]  # 0: off (sampling.process_probs)


class Requests(NamedTuple):
    """What each row asked for, on the devices of the side that reads it."""

    sampling: RowSampling
    stop_ids: Int[Array, "B S"]  # -1 padded
    max_new: Int[Array, " B"]
    # vLLM's min_tokens: the first min_new tokens of an answer are never a stop id
    # (target_logits masks them there).
    min_new: Int[Array, " B"]


class Seen(NamedTuple):
    """What the penalties read (sampling.penalize): how often each token occurs in each row's
    answer so far (the newest emitted token included), and which tokens its prompt holds."""

    counts: Int[Array, "B V"]
    in_prompt: Bool[Array, "B V"]


class RowState(NamedTuple):
    """Device-side state of the rows between steps (AR) or rounds (SD, SSD).

    prev: the token at position lengths-1 (committed). last: the newest emitted token r, at
    position `lengths`, not yet in any cache. generated: tokens emitted so far (r included).
    done: a stop token was emitted or the budget reached; the row's length is frozen.
    seen: the token counts the penalties read, None in a batch where no row asked for one
    (its programs then compute nothing for them). The target's are its law's; SD's drafting
    reads them, and SSD's draft side keeps its own copy (advanced alike), so the draft
    proposes as the penalised target would (speculation.steer; any proposal is exact).
    """

    prev: Int[Array, " B"]
    last: Int[Array, " B"]
    lengths: Int[Array, " B"]
    generated: Int[Array, " B"]
    done: Bool[Array, " B"]
    seen: Seen | None = None


def _id_mask(ids: Int[Array, "B N"], real: Bool[Array, "B N"], vocab_size: int
             ) -> Bool[Array, "B V"]:
    """Per row, which token ids occur among its real entries. A scatter-max, so padding
    entries (any id, real False) mark nothing."""
    B = ids.shape[0]
    return jnp.zeros((B, vocab_size), jnp.int32).at[jnp.arange(B)[:, None], jnp.maximum(
        ids, 0)].max(real.astype(jnp.int32)) > 0


def prompt_seen(tokens: Int[Array, "B T"], prompt_len: Int[Array, " B"], vocab_size: int
                ) -> Seen:
    """The penalties' state before the first answer token: no counts, the prompts' tokens."""
    real = jnp.arange(tokens.shape[1]) < prompt_len[:, None]
    return Seen(jnp.zeros((tokens.shape[0], vocab_size), jnp.int32),
                _id_mask(tokens, real, vocab_size))


def _count(seen: Seen, tokens: Int[Array, "B S"]) -> Seen:
    """`seen` with the tokens >= 0 of each row counted once more (-1 is padding)."""
    B = tokens.shape[0]
    counts = seen.counts.at[jnp.arange(B)[:, None], jnp.maximum(tokens, 0)].add(
        (tokens >= 0).astype(jnp.int32))
    return seen._replace(counts=counts)


def row_keys(sampling: RowSampling, stream: int, positions: Int[Array, " B"]) -> Key[Array, " B"]:
    """The key of a row's draw at a position: a function of the request's seed alone."""
    return jax.vmap(lambda k, p: jax.random.fold_in(jax.random.fold_in(k, stream), p))(
        sampling.keys, positions)


def target_logits(logits: Float[Array, "B S V"], req: Requests, first: Int[Array, " B"],
                  seen: Seen | None = None, drafts: Int[Array, "B K"] | None = None
                  ) -> Float[Array, "B S V"]:
    """The logits whose distribution the output follows: the raw logits plus each row's
    logit_bias, then its penalties given `seen` (position s counts the drafts before it,
    drafts[:, :s], as emitted: the law of position s is the one that holds once they are
    accepted), with the row's stop ids at -inf where position s would emit answer token
    number first + s (1-based) <= min_tokens. The output follows these; the draft proposes
    from logits moved the same way (speculation.steer), but may propose anything, and
    verification against these stays exact."""
    s = req.sampling
    logits = add_bias(logits, s.bias_ids, s.bias)
    B, S, V = logits.shape
    if seen is not None:
        def penalized(x):
            counts = jnp.broadcast_to(seen.counts[:, None], (B, S, V))
            if drafts is not None and S > 1:
                # in_draft[b, j, v]: draft j of row b is v; position s adds drafts j < s.
                in_draft = (drafts[:, :S - 1, None] == jnp.arange(V)).astype(jnp.int32)
                counts = counts + jnp.concatenate(
                    [jnp.zeros((B, 1, V), jnp.int32), jnp.cumsum(in_draft, axis=1)], axis=1)
            return penalize(x, counts, seen.in_prompt, s.presence, s.frequency, s.repetition)

        on = (s.presence != 0) | (s.frequency != 0) | (s.repetition != 1)
        # The vocabulary-wide passes only when some row asks (a live batch always carries
        # the counts, and most of its requests set no penalty).
        logits = jax.lax.cond(jnp.any(on), penalized, lambda x: x.astype(jnp.float32), logits)
    return hold_stops(logits, req.stop_ids, first[:, None] + jnp.arange(S), req.min_new)


def hold_stops(logits: Float[Array, "B S V"], stop_ids: Int[Array, "B N"],
               number: Int[Array, "B S"], min_new: Int[Array, " B"]) -> Float[Array, "B S V"]:
    """vLLM's min_tokens: each row's stop ids (columns of `logits`, -1 pads) at -inf where the
    position would emit answer token `number` (1-based) <= min_new."""
    early = number <= min_new[:, None]
    is_stop_id = _id_mask(stop_ids, stop_ids >= 0, logits.shape[-1])
    return jnp.where(early[:, :, None] & is_stop_id[:, None, :], -jnp.inf, logits)


def is_stop(tokens: Int[Array, " B"], stop_ids: Int[Array, "B S"]) -> Bool[Array, " B"]:
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def start_rows(tokens: Int[Array, "B T"], prompt_len: Int[Array, " B"], first: Int[Array, " B"],
               req: Requests, seen: Seen | None = None) -> RowState:
    """The rows after prefill sampled `first` at position prompt_len (both sides build it;
    the target's with `seen`, prompt_seen's, when the batch has penalties)."""
    prev = jnp.take_along_axis(tokens, (prompt_len - 1)[:, None], 1)[:, 0]
    done = is_stop(first, req.stop_ids) | (req.max_new <= 1)
    seen = None if seen is None else _count(seen, first[:, None])
    return RowState(prev, first, prompt_len, jnp.ones_like(prompt_len), done, seen)


def emitted_tokens(drafts: Int[Array, "B K"], n: Int[Array, " B"], t: Int[Array, " B"]
                   ) -> Int[Array, "B K1"]:
    """s_1..s_n, t*, then -1 padding: the n+1 tokens a round emits."""
    B, K = drafts.shape
    idx = jnp.arange(K + 1)[None]
    # (zeros_like(drafts[:, :1]) would be [B, 0] when K = 0, an AR step, losing t)
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), drafts.dtype)], axis=1)
    return jnp.where(idx < n[:, None], padded, jnp.where(idx == n[:, None], t[:, None], -1))


def advance(rows: RowState, drafts: Int[Array, "B K"], n: Int[Array, " B"],
            t: Int[Array, " B"], req: Requests) -> tuple[RowState, Int[Array, "B K1"]]:
    """After a round that accepted n of the drafts and emitted t: the emitted tokens (-1 for
    rows that were already done), stop/budget, the new length. K = 0 is an AR step."""
    out = emitted_tokens(drafts, n, t)
    hit_stop = jnp.any((out[:, :, None] == req.stop_ids[:, None, :]) & (out[:, :, None] >= 0),
                       axis=(1, 2))
    generated = rows.generated + n + 1
    done = rows.done | hit_stop | (generated >= req.max_new)
    prev = rows.last if drafts.shape[1] == 0 else jnp.where(
        n == 0, rows.last, jnp.take_along_axis(drafts, jnp.maximum(n - 1, 0)[:, None], 1)[:, 0])
    frozen = rows.done
    new = RowState(prev=jnp.where(frozen, rows.prev, prev),
                   last=jnp.where(frozen, rows.last, t),
                   lengths=jnp.where(frozen, rows.lengths, rows.lengths + n + 1),
                   generated=jnp.where(frozen, rows.generated, generated),
                   done=done)
    out = jnp.where(frozen[:, None], -1, out)
    if rows.seen is not None:
        new = new._replace(seen=_count(rows.seen, out))
    return new, out
