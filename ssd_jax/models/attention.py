"""The one attention primitive every forward goes through (jnp reference and CPU path).

    attend(q[B,T,Hq,D], cache_k/v[B,Hkv,S,D], prefix_len[B], new_k/v[B,U,Hkv,D], mask[B,T,U])

Queries attend to the committed prefix of the KV cache (slots < prefix_len[b]; later slots may
hold stale K/V from rejected speculation and are ignored) plus U new tokens under an arbitrary
mask (causal chain for prefill / AR / SD verification, a tree mask for SSD tree decoding).
The two parts are computed as separate softmax blocks and merged by their log-sum-exp, so the
cache is only read here: writing it happens in a separate donated `commit` (on XLA:CPU an update
and a read of the cache in one jit costs a full cache copy per layer).

The cache is head-major, [B, Hkv, S, D]: each (row, head) dot then reads one contiguous [S, D]
slab. With the token-major [B, S, Hkv, D] layout XLA:CPU re-lays the cache out for the dot on
every call: 30 layers of SmolLM2 attention took 13.9 vs 6.8 ms at batch 1 (512 slots, one core)
and 329 vs 86 ms at batch 32 (256 slots).

The Pallas kernel in `pallas_kernels/tree_attention.py` implements exactly this signature and is
tested against this function; `select_attention` is the one place that picks between them.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.config import ATTENTION_BACKENDS

AttentionFn = Callable[..., Array]

# A finite "minus infinity": a query row whose keys are all masked (a padding row) then yields a
# harmless average instead of NaN, and NaNs never leak into real rows through later layers.
MASK_VALUE = -1e30


def attend(
    q: Float[Array, "B T Hq D"],
    cache_k: Float[Array, "B Hkv S D"],
    cache_v: Float[Array, "B Hkv S D"],
    prefix_len: Int[Array, " B"],
    new_k: Float[Array, "B U Hkv D"],
    new_v: Float[Array, "B U Hkv D"],
    mask: Bool[Array, "B T U"],
    *,
    scale: float | None = None,
) -> Float[Array, "B T Hq D"]:
    B, T, Hq, D = q.shape
    Hkv, S, U = cache_k.shape[1], cache_k.shape[2], new_k.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    # Queries head-major, [B, Hkv, T*G, D]: each (row, kv head) is then one plain matmul against
    # its [S, D] cache slab. Left as [B, T, Hkv, G, D], XLA:CPU emits these contractions as
    # elemental loops: 2.3x slower here (draft tree step 7.3 vs 3.2 ms, target's 4-token
    # verification 11.5 vs 5.1 ms of attention, 700 slots, one core).
    qm = (q.astype(jnp.float32) * scale).reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4)
    qm = qm.reshape(B, Hkv, T * G, D)

    # Prefix block: only a per-row length mask.
    s_pre = jnp.einsum("bhmd,bhsd->bhms", qm, cache_k.astype(jnp.float32))
    valid = jnp.arange(S)[None, :] < prefix_len[:, None]  # [B, S]
    s_pre = jnp.where(valid[:, None, None, :], s_pre, MASK_VALUE)

    # New-token block: the caller's mask (chain or tree), the same for a query's G heads.
    new_k = new_k.astype(jnp.float32).transpose(0, 2, 1, 3)  # [B, Hkv, U, D]
    new_v = new_v.astype(jnp.float32).transpose(0, 2, 1, 3)
    s_new = jnp.einsum("bhmd,bhud->bhmu", qm, new_k)
    mask = jnp.broadcast_to(mask[:, None, :, None, :], (B, 1, T, G, U)).reshape(B, 1, T * G, U)
    s_new = jnp.where(mask, s_new, MASK_VALUE)

    m = jnp.maximum(s_pre.max(-1, keepdims=True), s_new.max(-1, keepdims=True))
    p_pre = jnp.exp(s_pre - m)
    p_new = jnp.exp(s_new - m)
    denom = p_pre.sum(-1, keepdims=True) + p_new.sum(-1, keepdims=True)  # [B, Hkv, T*G, 1]
    out = (jnp.einsum("bhms,bhsd->bhmd", p_pre, cache_v.astype(jnp.float32))
           + jnp.einsum("bhmu,bhud->bhmd", p_new, new_v)) / denom
    out = out.reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4)  # back to [B, T, Hkv, G, D]
    return out.reshape(B, T, Hq, D).astype(q.dtype)


def causal_mask(batch: int, num_tokens: int) -> Bool[Array, "B T T"]:
    """Chain mask for prefill, AR steps and SD verification: token t sees new tokens 0..t."""
    m = jnp.tril(jnp.ones((num_tokens, num_tokens), dtype=bool))
    return jnp.broadcast_to(m, (batch, num_tokens, num_tokens))


def select_attention(backend: str = "auto", platform: str | None = None) -> AttentionFn:
    """The attention implementation for `ModelConfig.attention_backend` on `platform` (default
    `jax.default_backend()`): "auto" is the Pallas kernel on GPU/TPU and `attend` elsewhere;
    "jnp" is `attend` anywhere; "pallas" is the kernel (GPU/TPU only); "pallas-interpret" is the
    kernel's GPU program interpreted, on any platform (CPU dry runs of the kernel path)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r}: use one of {ATTENTION_BACKENDS}")
    platform = jax.default_backend() if platform is None else platform
    lowering = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(platform)
    if backend == "jnp" or (backend == "auto" and lowering is None):
        return attend
    if backend == "pallas" and lowering is None:
        raise ValueError(f"attention_backend='pallas' needs a GPU or TPU, not {platform!r}: use "
                         f"'auto' or 'jnp', or 'pallas-interpret' for the kernel interpreted "
                         f"(~100x slower)")
    # Imported here: the Pallas modules (Triton, Mosaic) cost start-up time the CPU path skips.
    from pallas_kernels.tree_attention import tree_attention
    if backend == "pallas-interpret":  # the GPU program interprets far faster than the TPU one
        return functools.partial(tree_attention, backend="gpu", interpret=True)
    return functools.partial(tree_attention, backend=lowering)
