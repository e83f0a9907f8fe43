"""Per-device bytes of weights, KV caches and the SSD speculation cache, from `jax.eval_shape` trees.

Nothing is allocated: every number is a sum over ShapeDtypeStructs. A tensor's per-device shard
comes from JAX itself (`NamedSharding(AbstractMesh, spec).shard_shape`) under the same logical-axis
rules the runtime uses (`ssd_jax.sharding.spec_for`): heads / kv_heads / mlp / vocab split over
the mesh's TP degree, replicated when the unit count is not a multiple of it.

The weight tree is traced for a one-layer model and the layer leaves counted `num_layers` times:
every Block is built from the same config, so this is exact (the tests check it against the
full tree), and it keeps planning an 80-layer model instant instead of ~10 s of module tracing.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssd_jax.config import ModelConfig
from ssd_jax.core.draft import SpecCache
from ssd_jax.loading.weights import abstract_model
from ssd_jax.models.transformer import KVCache
from ssd_jax.sharding import TP, kv_spec, spec_for


def shard_nbytes(x: jax.ShapeDtypeStruct, spec: P, tp: int) -> int:
    """Bytes of one device's shard of `x` laid out by `spec` on a 1-D mesh of `tp` devices."""
    shape = NamedSharding(AbstractMesh((tp,), (TP,)), spec).shard_shape(x.shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def tree_nbytes(tree, spec: P = P(), tp: int = 1) -> int:
    return sum(shard_nbytes(x, spec, tp) for x in jax.tree.leaves(tree))


@dataclass(frozen=True)
class WeightBytes:
    """One device's share of a model's parameters."""

    total: int  # bytes
    embed_table: int  # bytes of an untied input embedding: a decode step reads only B*T rows
    matmul_params: int  # elements of matmul weights (incl. a tied LM head): 2 FLOPs per token


@functools.lru_cache(maxsize=64)
def weight_bytes(config: ModelConfig, tp: int = 1) -> WeightBytes:
    one_layer = abstract_model(config.replace(num_layers=1))
    total = embed = matmul = 0
    for path, var in nnx.to_flat_state(nnx.state(one_layer, nnx.Param)):
        x = var.get_value()
        count = config.num_layers if path[0] == "layers" else 1
        nbytes = count * shard_nbytes(x, spec_for(path, config, tp), tp)
        total += nbytes
        kind = path[-1]
        if kind == "embedding" and not config.tie_embeddings:
            embed += nbytes
        elif kind in ("kernel", "embedding"):
            matmul += nbytes // jnp.dtype(x.dtype).itemsize
    return WeightBytes(total, embed, matmul)


def kv_cache_bytes(config: ModelConfig, batch: int, seq_len: int, tp: int = 1) -> int:
    cache = jax.eval_shape(lambda: KVCache.zeros(config, batch, seq_len))
    return tree_nbytes(cache, kv_spec(config, tp), tp)


def spec_cache_bytes(batch: int, m: int, k: int, vocab: int, sampling: bool) -> int:
    """The draft mesh's SpecCache (replicated): keys, tokens [B,M,K], q' [B,M,K,V] fp32 only
    when some row samples (greedy rows need no distribution to verify against)."""
    i32, f32 = jnp.int32, jnp.float32
    cache = SpecCache(
        branch_j=jax.ShapeDtypeStruct((batch, m), i32),
        fork_tok=jax.ShapeDtypeStruct((batch, m), i32),
        tokens=jax.ShapeDtypeStruct((batch, m, k), i32),
        q=jax.ShapeDtypeStruct((batch, m, k, vocab), f32) if sampling else None,
        cand=jax.ShapeDtypeStruct((batch, k + 1, min(m, vocab)), i32))
    return tree_nbytes(cache)


def tree_kv_bytes(config: ModelConfig, batch: int, m: int, k: int, tp: int = 1) -> int:
    """Uncommitted glue + branch K/V the tree decode carries: [B, K+1+M*K, Hkv, D] per layer."""
    return kv_cache_bytes(config, batch, k + 1 + m * k, tp)


def speculation_bytes(batch: int, k: int, vocab: int, sampling: bool) -> int:
    """What the target mesh receives each round: tokens [B,K] and q' [B,K,V] fp32 if sampling."""
    return batch * k * 4 + (batch * k * vocab * 4 if sampling else 0)
