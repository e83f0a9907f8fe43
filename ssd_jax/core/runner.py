"""One model's parameters on its devices and the jitted programs every mode uses: prefill,
the AR decode step, multi-token scoring, cache fill.

The NNX model is split once into (graphdef, params); every program is a pure `jax.jit` function
that merges them inside the trace, so a call costs a plain jit dispatch: the graph, hashed once,
is a static argument and the params travel as a flat list (graph.py). Programs return new K/V
rather than writing the cache: `commit` (donated, in place) writes it, so the big cache is only
read inside a program (the XLA:CPU cache-copy trap, platform notes).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.config import ModelConfig
from ssd_jax.core.graph import Graph
from ssd_jax.core.logprobs import TokenLogprobs, blockwise_token_logprobs, token_logprobs
from ssd_jax.core.rows import (SAMPLE_STREAM, Requests, RowState, Seen, advance, prompt_seen,
                               row_keys, start_rows, target_logits)
from ssd_jax.draft_vocab import DraftModel
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, Transformer, commit
from ssd_jax.sampling import next_token
from ssd_jax.sharding import put


def _merge(graphdef, params) -> Transformer | DraftModel:
    return graphdef.merge(params)


def _sample(logits: Float[Array, "B V"], req: Requests, positions: Int[Array, " B"],
            number: Int[Array, " B"], seen: Seen | None) -> Int[Array, " B"]:
    """Draw answer token `number` (1-based) of each row from rows.target_logits."""
    s = req.sampling
    return next_token(target_logits(logits[:, None], req, number, seen)[:, 0], s.temperature,
                      s.top_k, s.top_p, row_keys(s, SAMPLE_STREAM, positions), s.min_p)


@partial(jax.jit, static_argnames=("graphdef",))
def forward(graphdef, params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
            cache: KVCache, prefix_len: Int[Array, " B"], mask: Bool[Array, "B T T"]
            ) -> tuple[Float[Array, "B T V"], KVCache]:
    """Score T new tokens per row after the committed prefix (step costs, tests)."""
    return _merge(graphdef, params)(tokens, positions, cache, prefix_len, mask)


@partial(jax.jit, static_argnames=("graphdef",))
def fill_kv(graphdef, params, tokens: Int[Array, "B T"], cache: KVCache):
    B, T = tokens.shape
    no_prefix = jax.lax.optimization_barrier(jnp.zeros((B,), jnp.int32))  # see prefill
    return _merge(graphdef, params)(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), cache,
                                    no_prefix, causal_mask(B, T),
                                    logit_index=jnp.zeros((B, 1), jnp.int32))


@partial(jax.jit, static_argnames=("graphdef", "logprobs", "prompt_logprobs", "penalties"))
def prefill(graphdef, params, tokens: Int[Array, "B T"], prompt_len: Int[Array, " B"],
            cache: KVCache, req: Requests, logprobs: int | None = None,
            prompt_logprobs: bool = False, penalties: bool = False
            ) -> tuple[RowState, KVCache, TokenLogprobs | None]:
    """Right-padded prompts -> the first sampled token, the prompt K/V (not yet committed) and,
    given `logprobs` (a top-N width), the first token's log-probabilities (logprobs.py), [B, 1].

    `prompt_logprobs` (with `logprobs`): the log-probabilities cover every position, [B, T]:
    position t scores prompt token t + 1 under the logits at t, and position prompt_len - 1
    the first sampled token (positions past it are padding). The first token is still drawn
    from the last position's logits alone, the program a request without them runs, so asking
    moves no token.

    `penalties`: the rows carry the token counts the penalties read (rows.Seen), from here on.

    Padding needs no extra mask: under the causal mask a real token at t < len only sees
    keys <= t, and the pad slots' K/V are overwritten by later commits."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    # An opaque zero: with a literal 0 prefix length XLA constant-folds the all-masked prefix
    # scores ([B, H, T, S] per layer), which took ~2 min per layer group to compile at B=32, T=128.
    no_prefix = jax.lax.optimization_barrier(jnp.zeros((B,), jnp.int32))
    model = _merge(graphdef, params)
    x, new_kv = model.hidden(tokens, positions, cache, no_prefix, causal_mask(B, T))
    logits = model.head(x, (prompt_len - 1)[:, None])
    seen = prompt_seen(tokens, prompt_len, logits.shape[-1]) if penalties else None
    first = _sample(logits[:, 0], req, prompt_len, jnp.ones_like(prompt_len), seen)
    lp = None
    if logprobs is not None and prompt_logprobs:
        nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
        nxt = jnp.where(jnp.arange(T) == (prompt_len - 1)[:, None], first[:, None], nxt)
        lp = blockwise_token_logprobs(model.head, x, nxt, logprobs)
    elif logprobs is not None:
        lp = token_logprobs(logits, first[:, None], logprobs)
    return start_rows(tokens, prompt_len, first, req, seen), new_kv, lp


@partial(jax.jit, static_argnames=("graphdef", "logprobs"))
def decode_step(graphdef, params, rows: RowState, cache: KVCache, req: Requests,
                logprobs: int | None = None
                ) -> tuple[RowState, KVCache, TokenLogprobs | None]:
    """Feed each row's last token, sample the next. Returns the new K/V to commit at
    `rows.lengths` (and the next token's log-probabilities, given `logprobs`). A finished row
    keeps its length, so it never runs past its cache slack."""
    B = rows.last.shape[0]
    logits, new_kv = _merge(graphdef, params)(rows.last[:, None], rows.lengths[:, None], cache,
                                              rows.lengths, jnp.ones((B, 1, 1), bool))
    nxt = _sample(logits[:, 0], req, rows.lengths + 1, rows.generated + 1, rows.seen)
    new, _ = advance(rows, jnp.zeros((B, 0), jnp.int32), jnp.zeros_like(nxt), nxt, req)
    lp = None if logprobs is None else token_logprobs(logits, nxt[:, None], logprobs)
    return new, new_kv, lp


def _place_weights(model, mesh, cpu_kernels: bool, precision: str) -> bool:
    """Pack `model` for the CPU kernel (kernels/cpu.py), in `precision`'s form, where its
    programs run on one CPU device, or unpack it for a mesh of several (the same model may
    serve both: SSD's draft on its own device and SD's on the target's). Returns whether it
    is packed."""
    from ssd_jax.models.packing import is_packed, pack_model, packed_precision, unpack_model
    devices = jax.devices() if mesh is None else list(mesh.devices.flat)
    one_cpu = (mesh is None or len(devices) == 1) and devices[0].platform == "cpu"
    if one_cpu and cpu_kernels:
        from ssd_jax.kernels import cpu
        if packed_precision(model) not in (None, precision):
            unpack_model(model)  # packed the other way (bf16 weights unpack rounded)
        if is_packed(model) or (cpu.available() and pack_model(model, precision) > 0):
            return True
    if is_packed(model):
        unpack_model(model)
    return False


class ModelRunner:
    """Holds one model's split params (sharded over `mesh`, if given) and dispatches its
    programs. On one CPU device (and `cpu_kernels`) the model's fp32 weights are packed for
    the CPU kernel in place, so the model and the runner share them; such a model still runs
    forward, but has no gradient (pass cpu_kernels=False for a model you will train).
    precision="bf16" packs the kernel's bf16 form (weights and products' inputs in bf16, sums
    in fp32): a cheaper draft, a different model but no less exact a speculation, since
    verification uses the q each token was drawn from."""

    def __init__(self, model: Transformer | DraftModel, mesh=None, cpu_kernels: bool = True,
                 precision: str = "fp32"):
        self.config: ModelConfig = model.config
        self.packed = _place_weights(model, mesh, cpu_kernels, precision)
        graphdef, self.params = nnx.split(model)
        self.mesh = mesh
        if mesh is not None:  # tensor-parallel (or replicated) over this mesh
            from ssd_jax.sharding import shard_params
            self.params = shard_params(self.params, self.config, mesh)
        # What programs take (graph.py says why): the graph hashed once, the params flat.
        self.graphdef = Graph(graphdef, jax.tree.structure(self.params))
        self.leaves: list[jax.Array] = jax.tree.leaves(self.params)

    def new_cache(self, batch: int, seq_len: int) -> KVCache:
        from ssd_jax.sharding import new_cache
        return new_cache(self.config, batch, seq_len, self.mesh)

    def prefill(self, tokens, prompt_len, cache, req: Requests, logprobs: int | None = None,
                prompt_logprobs: bool = False, penalties: bool = False
                ) -> tuple[RowState, KVCache, TokenLogprobs | None]:
        rows, new_kv, lp = prefill(self.graphdef, self.leaves, tokens, prompt_len, cache, req,
                                   logprobs, prompt_logprobs, penalties)
        return rows, commit(cache, new_kv, prompt_len * 0), lp  # on prompt_len's devices

    def decode(self, rows: RowState, cache: KVCache, req: Requests, logprobs: int | None = None
               ) -> tuple[RowState, KVCache, TokenLogprobs | None]:
        new, new_kv, lp = decode_step(self.graphdef, self.leaves, rows, cache, req, logprobs)
        return new, commit(cache, new_kv, rows.lengths), lp

    def fill(self, tokens: Int[Array, "B T"], cache: KVCache) -> KVCache:
        """Write a prompt's K/V into the cache (a draft's prefill: its logits are not needed)."""
        _, new_kv = fill_kv(self.graphdef, self.leaves, tokens, cache)
        # Zeros put explicitly on this mesh: a default-device array would be moved there
        # implicitly, which a run under transfer_guard_device_to_device("disallow") refuses.
        zeros = np.zeros((tokens.shape[0],), np.int32)
        if self.mesh is not None:
            zeros = put(zeros, NamedSharding(self.mesh, P()))
        return commit(cache, new_kv, zeros)

    def forward(self, tokens, positions, cache, prefix_len, mask):
        return forward(self.graphdef, self.leaves, tokens, positions, cache, prefix_len, mask)
