"""Jitted programs over one model: prefill, decode step, multi-token scoring, cache commit.

The NNX model is split once into (graphdef, params); every program is a pure `jax.jit` function
that merges them inside the trace, so a call costs a plain jit dispatch (no NNX graph walk on the
host per step) and the graphdef, being hashable, is a static argument.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, Key

from ssd_jax.config import ModelConfig
from ssd_jax.draft_vocab import DraftModel
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, Transformer, commit
from ssd_jax.sampling import next_token


class RowSampling(NamedTuple):
    """Per-row sampling settings as device arrays, so one compiled step serves any mix."""

    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]
    keys: Key[Array, " B"]  # one base key per request; step keys are fold_in(key, position)


class DecodeState(NamedTuple):
    """Device-side state of an AR batch between steps.

    tokens: the last sampled token of each row (not yet in the cache).
    lengths: committed cache length per row (= position of `tokens`).
    generated: tokens generated so far per row (including `tokens`).
    done: the row has emitted a stop token or reached its budget; its length stops growing.
    """

    tokens: Int[Array, " B"]
    lengths: Int[Array, " B"]
    generated: Int[Array, " B"]
    done: Bool[Array, " B"]


def _merge(graphdef, params) -> Transformer | DraftModel:
    return nnx.merge(graphdef, params)


@partial(jax.jit, static_argnames=("graphdef",))
def forward(graphdef, params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
            cache: KVCache, prefix_len: Int[Array, " B"], mask: Bool[Array, "B T T"]
            ) -> tuple[Float[Array, "B T V"], KVCache]:
    """Score T new tokens per row after the committed prefix (SD verification, tests)."""
    return _merge(graphdef, params)(tokens, positions, cache, prefix_len, mask)


@partial(jax.jit, static_argnames=("graphdef",))
def fill_kv(graphdef, params, tokens: Int[Array, "B T"], cache: KVCache):
    B, T = tokens.shape
    no_prefix = jax.lax.optimization_barrier(jnp.zeros((B,), jnp.int32))  # see prefill
    return _merge(graphdef, params)(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), cache,
                                    no_prefix, causal_mask(B, T),
                                    logit_index=jnp.zeros((B, 1), jnp.int32))


def _is_stop(tokens: Int[Array, " B"], stop_ids: Int[Array, "B S"]) -> Bool[Array, " B"]:
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def _step_keys(sampling: RowSampling, positions: Int[Array, " B"]):
    # Keyed by position, not by step count, so a request's samples do not depend on batching.
    return jax.vmap(jax.random.fold_in)(sampling.keys, positions)


@partial(jax.jit, static_argnames=("graphdef",))
def prefill(graphdef, params, tokens: Int[Array, "B T"], prompt_len: Int[Array, " B"],
            cache: KVCache, sampling: RowSampling, stop_ids: Int[Array, "B S"],
            max_new: Int[Array, " B"]) -> tuple[DecodeState, KVCache]:
    """Right-padded prompts -> first sampled token and the prompt K/V (not yet committed).

    Padding needs no extra mask: under the causal mask a real token at t < len only sees
    keys <= t, and the pad slots' K/V are overwritten by later commits."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    # An opaque zero: with a literal 0 prefix length XLA constant-folds the all-masked prefix
    # scores ([B, H, T, S] per layer), which took ~2 min per layer group to compile at B=32, T=128.
    no_prefix = jax.lax.optimization_barrier(jnp.zeros((B,), jnp.int32))
    logits, new_kv = _merge(graphdef, params)(
        tokens, positions, cache, no_prefix, causal_mask(B, T),
        logit_index=(prompt_len - 1)[:, None])
    first = next_token(logits[:, 0], sampling.temperature, sampling.top_k, sampling.top_p,
                       _step_keys(sampling, prompt_len))
    done = _is_stop(first, stop_ids) | (max_new <= 1)
    return DecodeState(first, prompt_len, jnp.ones_like(prompt_len), done), new_kv


@partial(jax.jit, static_argnames=("graphdef",))
def decode_step(graphdef, params, state: DecodeState, cache: KVCache, sampling: RowSampling,
                stop_ids: Int[Array, "B S"], max_new: Int[Array, " B"]
                ) -> tuple[DecodeState, KVCache]:
    """Feed each row's last token, sample the next. Returns the new K/V to commit at
    `state.lengths` (the cache is only read here; see models/attention.py)."""
    B = state.tokens.shape[0]
    logits, new_kv = _merge(graphdef, params)(
        state.tokens[:, None], state.lengths[:, None], cache, state.lengths,
        jnp.ones((B, 1, 1), bool))
    positions = state.lengths + 1
    nxt = next_token(logits[:, 0], sampling.temperature, sampling.top_k, sampling.top_p,
                     _step_keys(sampling, positions))
    generated = state.generated + 1
    done = state.done | _is_stop(nxt, stop_ids) | (generated >= max_new)
    # A finished row keeps its length, so it never runs past its cache slack.
    lengths = jnp.where(state.done, state.lengths, positions)
    nxt = jnp.where(state.done, state.tokens, nxt)
    generated = jnp.where(state.done, state.generated, generated)
    return DecodeState(nxt, lengths, generated, done), new_kv


class ModelRunner:
    """Holds one model's split params and dispatches its jitted programs."""

    def __init__(self, model: Transformer | DraftModel, mesh=None):
        self.config: ModelConfig = model.config
        self.graphdef, self.params = nnx.split(model)
        self.mesh = mesh
        if mesh is not None:  # tensor-parallel (or replicated) over this mesh
            from ssd_jax.sharding import shard_params
            self.params = shard_params(self.params, self.config, mesh)

    def new_cache(self, batch: int, seq_len: int) -> KVCache:
        from ssd_jax.sharding import new_cache
        return new_cache(self.config, batch, seq_len, self.mesh)

    def prefill(self, tokens, prompt_len, cache, sampling, stop_ids, max_new):
        state, new_kv = prefill(self.graphdef, self.params, tokens, prompt_len, cache, sampling,
                                stop_ids, max_new)
        cache = commit(cache, new_kv, prompt_len * 0)  # on prompt_len's devices, not device 0
        return state, cache

    def decode(self, state: DecodeState, cache: KVCache, sampling, stop_ids, max_new):
        new_state, new_kv = decode_step(self.graphdef, self.params, state, cache, sampling,
                                        stop_ids, max_new)
        return new_state, commit(cache, new_kv, state.lengths)

    def fill(self, tokens: Int[Array, "B T"], cache: KVCache) -> KVCache:
        """Write a prompt's K/V into the cache (a draft's prefill: its logits are not needed)."""
        _, new_kv = fill_kv(self.graphdef, self.params, tokens, cache)
        return commit(cache, new_kv, jnp.zeros((tokens.shape[0],), jnp.int32))

    def forward(self, tokens, positions, cache, prefix_len, mask):
        return forward(self.graphdef, self.params, tokens, positions, cache, prefix_len, mask)
