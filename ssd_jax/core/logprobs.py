"""The target's log-probabilities of the tokens it emits, for the server's `logprobs`.

They are the model's own distribution, log_softmax of the target's logits at the position that
emitted the token, before temperature, top-k or top-p (vLLM's default, "raw" logprobs): a
property of the model and the text, the same whichever mode (AR, SD, SSD) produced the text.
Speculation changes which program scores a position, never the logits it scores there, so
every mode reports the same numbers up to float rounding (tests/test_logprobs.py compares them
with a plain forward over the whole text).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


class TokenLogprobs(NamedTuple):
    """Per emitted position: the chosen token's log-probability and the N most likely tokens.
    Positions that emitted nothing (token -1) hold the top-N of their logits all the same;
    readers skip them as they skip the -1."""

    chosen: Float[Array, "B T"]
    top_ids: Int[Array, "B T N"]
    top: Float[Array, "B T N"]


class HostLogprobs(NamedTuple):
    """TokenLogprobs read back to the host (numpy), as the server consumes them."""

    chosen: np.ndarray  # [B, T] float32
    top_ids: np.ndarray  # [B, T, N] int32
    top: np.ndarray  # [B, T, N] float32


def token_logprobs(logits: Float[Array, "B T V"], tokens: Int[Array, "B T"], n: int
                   ) -> TokenLogprobs:
    """log p(tokens[b, t]) under logits[b, t], and the n most likely tokens there (n >= 0)."""
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [B, T]
    picked = jnp.take_along_axis(logits, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    top, ids = jax.lax.top_k(logits, n)
    return TokenLogprobs(picked.astype(jnp.float32) - lse, ids.astype(jnp.int32),
                         top.astype(jnp.float32) - lse[..., None])


def blockwise_token_logprobs(head, x: Float[Array, "B T D"], tokens: Int[Array, "B T"], n: int,
                             block: int = 256) -> TokenLogprobs:
    """token_logprobs of head(x) (hidden states -> logits), `block` positions at a time: a
    prompt's log-probabilities need logits at every position, and [T, V] of them at once is
    1.2 GB for 2,048 positions of Qwen2.5's 151,936 tokens; a block is 156 MB. T is padded up
    to a multiple of `block` (the padding's rows are dropped)."""
    B, T, D = x.shape
    block = min(block, T)
    pad = -T % block
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)))
    nb = (T + pad) // block
    xs = x.reshape(B, nb, block, D).swapaxes(0, 1)
    ts = tokens.reshape(B, nb, block).swapaxes(0, 1)
    out = jax.lax.map(lambda xt: token_logprobs(head(xt[0]), xt[1], n), (xs, ts))

    def join(a):  # [nb, B, block, ...] -> [B, T, ...]
        a = a.swapaxes(0, 1)
        return a.reshape((B, nb * block) + a.shape[3:])[:, :T]
    return TokenLogprobs(*(join(a) for a in out))


def with_logprobs(out: np.ndarray, lp: TokenLogprobs | HostLogprobs, rows: int
                  ) -> list[list[tuple]]:
    """A round's (or step's) emitted tokens [B, T] (-1: none) and their TokenLogprobs -> per
    real row, (token, logprob, {id: logprob} of the top-N) for each emitted token."""
    chosen, top_ids, top = (np.asarray(a) for a in lp)
    return [[(int(out[b, i]), float(chosen[b, i]),
              dict(zip(top_ids[b, i].tolist(), top[b, i].tolist())))
             for i in range(out.shape[1]) if out[b, i] >= 0] for b in range(rows)]
