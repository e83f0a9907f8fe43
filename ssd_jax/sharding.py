"""Device split into a target mesh and a disjoint draft mesh, and tensor-parallel sharding rules.

Rules are written once, by logical axis name, and mapped to the mesh axis "tp":
  heads / kv_heads  -> q,k,v projections (and Qwen2's biases) split on their output (head)
                       columns, o_proj on rows;
  mlp               -> gate/up on columns, down on rows (Megatron-style: one all-reduce per block);
  vocab             -> embedding rows and LM-head columns;
  everything else   -> replicated.
A logical axis whose size is not a multiple of the TP degree (SmolLM2's 3 KV heads on 2 devices)
is replicated instead of split, so any model runs on any mesh, only less parallel.
The KV cache follows kv_heads, so attention never moves the cache between devices.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssd_jax.config import ModelConfig
from ssd_jax.models.transformer import KVCache

TP = "tp"

# parameter path suffix -> logical axes of its dimensions (nnx.Linear kernels are [in, out])
LOGICAL_AXES = {
    ("q_proj", "kernel"): (None, "heads"),
    ("k_proj", "kernel"): (None, "kv_heads"),
    ("v_proj", "kernel"): (None, "kv_heads"),
    ("q_proj", "bias"): ("heads",),  # Qwen2's q/k/v biases follow their projections' columns
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", None),
    ("gate_proj", "kernel"): (None, "mlp"),
    ("up_proj", "kernel"): (None, "mlp"),
    ("down_proj", "kernel"): ("mlp", None),
    ("embed_tokens", "embedding"): ("vocab", None),
    ("lm_head", "kernel"): (None, "vocab"),
}


def logical_sizes(config: ModelConfig) -> dict[str, int]:
    """How many units each logical axis splits into (heads, not head*dim columns)."""
    return {"heads": config.num_heads, "kv_heads": config.num_kv_heads,
            "mlp": config.intermediate_size, "vocab": config.vocab_size}


def spec_for(path: tuple, config: ModelConfig, tp: int) -> P:
    axes = LOGICAL_AXES.get(tuple(str(p) for p in path[-2:]))
    if axes is None or tp == 1:
        return P()
    sizes = logical_sizes(config)
    return P(*(TP if a is not None and sizes[a] % tp == 0 else None for a in axes))


@dataclass(frozen=True)
class DeviceSplit:
    """The target mesh and the disjoint draft mesh (1-D, axis "tp")."""

    target: Mesh
    draft: Mesh

    @property
    def target_replicated(self) -> NamedSharding:
        return NamedSharding(self.target, P())

    @property
    def draft_replicated(self) -> NamedSharding:
        return NamedSharding(self.draft, P())


def plan_split(devices, n_target: int, n_draft: int) -> tuple[list, list]:
    """Which devices the target and the draft get (disjoint).

    Devices are ordered by (host, id). On one host the target takes the first n_target and the
    draft the next n_draft. On several hosts the draft gets whole hosts from the end whenever
    n_draft is a multiple of the devices per host, so its programs and the target's never share
    a host (or its host-to-device links); otherwise it takes the last n_draft devices."""
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    if n_target < 1 or n_draft < 1:
        raise ValueError(f"device split {n_target}+{n_draft} is invalid: each side needs >= 1")
    if n_target + n_draft > len(devices):
        raise ValueError(
            f"device split {n_target} target + {n_draft} draft needs {n_target + n_draft} "
            f"devices, only {len(devices)} are visible: lower the split, or on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n_target + n_draft}")
    hosts: dict[int, list] = {}
    for d in devices:
        hosts.setdefault(d.process_index, []).append(d)
    if len(hosts) == 1:
        return devices[:n_target], devices[n_target:n_target + n_draft]
    per_host = {len(v) for v in hosts.values()}
    if len(per_host) == 1 and n_draft % (size := per_host.pop()) == 0:
        whole = list(hosts.values())
        draft_hosts = whole[len(whole) - n_draft // size:]
        rest = [d for h in whole[:len(whole) - n_draft // size] for d in h]
        return rest[:n_target], [d for h in draft_hosts for d in h]
    return devices[:n_target], devices[len(devices) - n_draft:]


def put(tree, sharding):
    """`jax.device_put(tree, sharding)`, also onto a mesh that spans other processes (a pod's
    group mesh), where device_put takes no array already committed to a device: there each
    process builds its own shards from the host value, which every process of the group holds
    alike (the same request, the same weights). None: leave the tree as it is."""
    if sharding is None:
        return tree
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(one(jax.random.key_data(x)),
                                            impl=jax.random.key_impl(x))
        v = np.asarray(x)
        return jax.make_array_from_callback(v.shape, sharding, lambda idx: v[idx])
    return jax.tree.map(one, tree)


def split_devices(n_target: int, n_draft: int, devices=None) -> DeviceSplit:
    target, draft = plan_split(list(devices if devices is not None else jax.devices()),
                               n_target, n_draft)
    return DeviceSplit(Mesh(np.array(target), (TP,)), Mesh(np.array(draft), (TP,)))


def _names(key_path) -> tuple[str, ...]:
    names = (str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in key_path)
    return tuple(n for n in names if n != "value")  # nnx Variables add a trailing .value


def param_shardings(params: nnx.State, config: ModelConfig, mesh: Mesh):
    """A pytree of NamedShardings matching `params` (what to pass to device_put / jit)."""
    tp = mesh.shape[TP]
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: NamedSharding(mesh, spec_for(_names(kp), config, tp)), params)


def shard_params(params: nnx.State, config: ModelConfig, mesh: Mesh) -> nnx.State:
    """Place a model's params on `mesh` by the logical rules (replicated on a 1-device mesh)."""
    shardings = param_shardings(params, config, mesh)
    if mesh.is_multi_process:  # a pod's group mesh: each process places its own shards
        return jax.tree.map(put, params, shardings)
    return jax.device_put(params, shardings)


def kv_spec(config: ModelConfig, tp: int) -> P:
    """KV [B, Hkv, S, D] follows kv_heads, so attention never moves the cache between devices
    (replicated when the heads do not split evenly, as their projections are then)."""
    return P(None, TP, None, None) if tp > 1 and config.num_kv_heads % tp == 0 else P()


def cache_sharding(config: ModelConfig, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, kv_spec(config, mesh.shape[TP]))


def new_cache(config: ModelConfig, batch: int, seq_len: int, mesh: Mesh | None) -> KVCache:
    cache = KVCache.zeros(config, batch, seq_len)
    return cache if mesh is None else put(cache, cache_sharding(config, mesh))
