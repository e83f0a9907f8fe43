"""Fast backup speculator: n-gram / prompt lookup over the row's own tokens, on device.

When the speculation cache misses, SSD needs the next K tokens at once. The neural backup (the
draft decoding K steps, in draft.py) gives good tokens at the draft's latency; this one costs
almost nothing: find the latest earlier occurrence of the row's last n tokens and propose what
followed it. Its guesses come from no distribution, so verification treats them as point-mass
proposals (verify.py), which keeps SSD lossless.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int


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
        # latest match: argmax over p of ok * p
        best = jnp.max(jnp.where(ok, idx[None, :], -1), axis=1)
        return best

    best = jnp.full((B,), -1)
    for n in range(max_n, 0, -1):
        cand = match_end(n)
        best = jnp.where(best >= 0, best, cand)
    start = jnp.where(best >= 0, best + 1, last_pos)
    pos = start[:, None] + jnp.arange(k)[None, :]
    pos = jnp.minimum(pos, last_pos[:, None])
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
