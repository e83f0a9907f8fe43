"""Decoder-only Llama-3.x / Qwen2 / Qwen3 transformer in Flax NNX.

Reads top to bottom: cache pytree, norm, attention, MLP, block, model. Every forward is one call
of the attention primitive (committed prefix + new tokens under a mask); the forward returns the
new K/V and never writes the cache — `commit` (a separate jitted, donated function) does.

Layers are a Python list and are unrolled at trace time: on XLA:CPU a `lax.scan` over stacked
layer weights was 2-3x slower for decode (platform notes).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.config import ModelConfig
from ssd_jax.kernels.cpu import packed_matmul
from ssd_jax.models.attention import AttentionFn, select_attention
from ssd_jax.models.rope import apply_rope, inverse_frequencies


class KVCache(NamedTuple):
    """Per-layer key/value caches, each [B, Hkv, S, D]. Slot s of row b is valid iff
    s < length[b]; the lengths live with the engine, not here."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, seq_len: int) -> "KVCache":
        shape = (batch, config.num_kv_heads, seq_len, config.head_dim)
        dtype = jnp.dtype(config.dtype)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)))

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def seq_len(self) -> int:
        return self.k[0].shape[2]


def _commit(cache: KVCache, new: KVCache, start: Int[Array, " B"]) -> KVCache:
    # One dynamic_update_slice per row: a vmapped update with per-row offsets lowers to a
    # scatter, which on XLA:CPU cost 16 ms per step for SmolLM2 instead of well under 1 ms.
    def write(c, n):
        n = n.astype(c.dtype).transpose(0, 2, 1, 3)  # [B, U, Hkv, D] -> the cache's [B, Hkv, U, D]
        for b in range(c.shape[0]):
            c = jax.lax.dynamic_update_slice(c, n[b:b + 1], (b, 0, start[b], 0))
        return c
    return jax.tree.map(write, cache, new)


# Donating the cache makes the update in place; without donation XLA copies every layer's cache.
commit = jax.jit(_commit, donate_argnums=0)
commit.__doc__ = """Write new K/V [B, U, Hkv, D] per layer into the cache at slots start[b]..start[b]+U-1.

The caller guarantees start[b] + U <= S (dynamic_update_slice would clamp silently)."""


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class Linear(nnx.Linear):
    """nnx.Linear whose kernel may be packed for the CPU kernel ([N/64, K, 64]: packing.py);
    an unpacked [K, N] kernel takes nnx.Linear's own product."""

    def __call__(self, x: Float[Array, "... K"]) -> Float[Array, "... N"]:
        kernel = self.kernel[...]
        if kernel.ndim == 2:
            return super().__call__(x)
        y = packed_matmul(x, kernel, self.out_features).astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]


def _linear(din: int, dout: int, dtype, rngs: nnx.Rngs, bias: bool = False) -> Linear:
    # A random init gives biases small random values too (zeros would leave them untested).
    return Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype,
                  kernel_init=nnx.initializers.normal(0.02),
                  bias_init=nnx.initializers.normal(0.02), rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, jnp.dtype(config.dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = _linear(c.hidden_size, c.num_heads * c.head_dim, dt, rngs, c.qkv_bias)
        self.k_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, dt, rngs, c.qkv_bias)
        self.v_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, dt, rngs, c.qkv_bias)
        self.o_proj = _linear(c.num_heads * c.head_dim, c.hidden_size, dt, rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, positions, inv_freq, cache_k, cache_v, prefix_len, mask,
                 attend_fn: AttentionFn, extra_k=None, extra_v=None):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        new_k, new_v = k, v
        if extra_k is not None:  # uncommitted K/V of earlier tokens (glue, tree branches)
            new_k = jnp.concatenate([extra_k.astype(k.dtype), k], axis=1)
            new_v = jnp.concatenate([extra_v.astype(v.dtype), v], axis=1)
        out = attend_fn(q, cache_k, cache_v, prefix_len, new_k, new_v, mask)
        return self.o_proj(out.reshape(B, T, -1)), k, v


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, dt, rngs)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, dt, rngs)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, dt, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, positions, inv_freq, cache_k, cache_v, prefix_len, mask, attend_fn,
                 extra_k=None, extra_v=None):
        h, k, v = self.self_attn(self.input_layernorm(x), positions, inv_freq, cache_k, cache_v,
                                 prefix_len, mask, attend_fn, extra_k, extra_v)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class Transformer(nnx.Module):
    """Returns fp32 logits and the new K/V of the T input tokens (the cache is read-only here)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dt = jnp.dtype(config.dtype)
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dt,
                                      param_dtype=dt, embedding_init=nnx.initializers.normal(0.02),
                                      rngs=rngs)
        self.layers = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.lm_head = (None if config.tie_embeddings
                        else _linear(config.hidden_size, config.vocab_size, dt, rngs))
        self.packed_head = nnx.data(None)  # a tied head's packed copy of the embedding, on a CPU

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        prefix_len: Int[Array, " B"],
        mask: Bool[Array, "B T U"],
        logit_index: Int[Array, "B N"] | None = None,
        extra: KVCache | None = None,
    ) -> tuple[Float[Array, "B N V"], KVCache]:
        """`logit_index` picks the positions whose logits are needed (the last prompt token in
        prefill): the LM head is the largest matmul of a small model, so skip the rest.

        `extra` holds K/V [B, U0, Hkv, D] of earlier uncommitted tokens (SSD's glue and tree
        branches); they join the new-token block ahead of this call's T tokens, so `mask` is
        [B, T, U0 + T]. Only this call's K/V are returned."""
        x, kv = self.hidden(tokens, positions, cache, prefix_len, mask, extra)
        return self.head(x, logit_index), kv

    def hidden(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], cache: KVCache,
               prefix_len: Int[Array, " B"], mask: Bool[Array, "B T U"],
               extra: KVCache | None = None) -> tuple[Float[Array, "B T D"], KVCache]:
        """The final-normed hidden states of every new token, and their K/V (`__call__`'s
        arguments): a caller that needs two sets of logits from one forward (the prefill's
        next token, and its prompt's log-probabilities) applies `head` twice."""
        inv_freq = jnp.asarray(inverse_frequencies(
            self.config.head_dim, self.config.rope_theta, self.config.rope_scaling))
        attend_fn = select_attention(self.config.attention_backend)
        x = self.embed_tokens(tokens)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, positions, inv_freq, cache.k[i], cache.v[i], prefix_len, mask,
                            attend_fn, *((extra.k[i], extra.v[i]) if extra is not None
                                         else (None, None)))
            new_k.append(k)
            new_v.append(v)
        return self.norm(x), KVCache(tuple(new_k), tuple(new_v))

    def head(self, x: Float[Array, "B T D"], logit_index: Int[Array, "B N"] | None = None
             ) -> Float[Array, "B N V"]:
        """fp32 logits of the hidden states at `logit_index` (None: all of them)."""
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[..., None], axis=1)
        if self.lm_head is None and self.packed_head is not None:  # tied, packed (packing.py)
            logits = packed_matmul(x, self.packed_head[...], self.config.vocab_size)
        elif self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)
