"""The target's step of an SD/SSD round: score [r, s_1..s_K] at L..L+K in one forward (causal
chain mask) -> p_0..p_K, verify exactly (verify.py) -> (n accepted, t emitted), advance the rows.

All K+1 target K/V are committed at L and the length advances by n+1: the rejected slots lie
beyond the new length and are overwritten next round (hence K+1 slots of cache slack).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ssd_jax.core.logprobs import TokenLogprobs, token_logprobs
from ssd_jax.core.rows import (VERIFY_STREAM, Requests, RowState, advance, row_keys,
                               target_logits)
from ssd_jax.core.speculation import Outcome, Speculation
from ssd_jax.core.verify import verify, verify_greedy
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, commit
from ssd_jax.sampling import process_probs


class TargetState(NamedTuple):
    """The target side between rounds: its rows and its KV cache."""

    rows: RowState
    cache: KVCache


@partial(jax.jit, static_argnames=("graphdef", "greedy_only", "logprobs"))
def verify_step(graphdef, params, state: TargetState, spec: Speculation, req: Requests,
                greedy_only: bool, logprobs: int | None = None
                ) -> tuple[RowState, Outcome, Int[Array, "B K1"], KVCache, TokenLogprobs | None]:
    """The target forward over [r, s] and exact verification: the advanced rows, the outcome,
    the emitted tokens [B, K+1] (-1 padded), the K+1 new K/V (committed by the caller) and,
    given `logprobs` (a top-N width), the emitted tokens' log-probabilities: position i of the
    round emitted out[:, i] from logits[:, i], the prediction after r, s_1..s_i."""
    rows = state.rows
    B, K = spec.tokens.shape
    tokens = jnp.concatenate([rows.last[:, None], spec.tokens], axis=1)
    positions = rows.lengths[:, None] + jnp.arange(K + 1)
    logits, kv = graphdef.merge(params)(tokens, positions, state.cache, rows.lengths,
                                             causal_mask(B, K + 1))
    s = req.sampling
    # The distribution the output follows: bias, penalties (position i counts s_1..s_i),
    # min_tokens (position i emits answer token generated + i + 1).
    biased = target_logits(logits, req, rows.generated + 1, rows.seen, spec.tokens)
    if greedy_only:
        n, t = verify_greedy(biased, spec.tokens)
    else:
        p = process_probs(biased, s.temperature, s.top_k, s.top_p, s.min_p)
        n, t = verify(p, spec.tokens, spec.q, spec.point_mass, s.temperature == 0,
                      row_keys(s, VERIFY_STREAM, rows.lengths))
    new_rows, out = advance(rows, spec.tokens, n, t, req)
    # Raw log-probabilities (logprobs.py): before bias and masks, as before temperature.
    lp = None if logprobs is None else token_logprobs(logits, out, logprobs)
    return new_rows, Outcome(n, t), out, kv, lp


def target_step(target, state: TargetState, spec: Speculation, req: Requests, greedy_only: bool,
                logprobs: int | None = None
                ) -> tuple[TargetState, Outcome, Int[Array, "B K1"], TokenLogprobs | None]:
    """One verification by `target` (a ModelRunner): the new state, the outcome, the emitted
    tokens and, given `logprobs`, their log-probabilities."""
    rows, outcome, out, kv, lp = verify_step(target.graphdef, target.leaves, state, spec, req,
                                             greedy_only, logprobs)
    return TargetState(rows, commit(state.cache, kv, state.rows.lengths)), outcome, out, lp
