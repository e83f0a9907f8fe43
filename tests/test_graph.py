"""Static graphs hash once: a program call must not walk the model's nnx graph on the host.

An H200 run found every program of both Qwen models at ~5 ms whatever its size: jit hashed the
nnx GraphDef (a Python walk over every node) on every call. These tests pin the fix."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ssd_jax.config import ModelConfig
from ssd_jax.core.graph import Graph
from ssd_jax.core.runner import ModelRunner, forward
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import Transformer

TINY = ModelConfig(arch="llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=3,
                   num_heads=2, num_kv_heads=1, head_dim=16, tie_embeddings=True)


def _runner(config=TINY, seed=0):
    return ModelRunner(Transformer(config, rngs=nnx.Rngs(seed)))


def _forward(runner):
    cache = runner.new_cache(1, 8)
    return runner.forward(jnp.ones((1, 2), jnp.int32), jnp.arange(2)[None], cache,
                          jnp.zeros((1,), jnp.int32), causal_mask(1, 2))


def test_program_calls_do_not_hash_the_nnx_graph(monkeypatch):
    runner = _runner()
    assert isinstance(runner.graphdef, Graph)
    _forward(runner)  # compiled; later calls are cache hits
    node_type = type(runner.graphdef.graphdef)
    walks = []
    original = node_type.__hash__
    monkeypatch.setattr(node_type, "__hash__", lambda self: walks.append(1) or original(self))
    for _ in range(3):
        _forward(runner)
    assert walks == [], f"{len(walks)} GraphDef hashes in 3 calls: the graph is hashed per call"


def test_equal_graphs_share_programs_and_different_ones_do_not():
    a, b = _runner(seed=0), _runner(seed=1)  # same architecture, other weights
    assert a.graphdef == b.graphdef and hash(a.graphdef) == hash(b.graphdef)
    other = _runner(TINY.replace(num_layers=2))
    assert a.graphdef != other.graphdef
    assert a.graphdef != a.graphdef.graphdef  # only Graphs compare equal to a Graph


def test_programs_take_flat_params_and_merge_them_as_the_state():
    runner = _runner()
    assert len(runner.leaves) == len(jax.tree.leaves(runner.params))
    merged = nnx.state(runner.graphdef.merge(runner.leaves))
    for got, want in zip(jax.tree.leaves(merged), jax.tree.leaves(runner.params), strict=True):
        assert got is want  # the same arrays, in the State's order
    cache = runner.new_cache(1, 8)
    args = (jnp.ones((1, 2), jnp.int32), jnp.arange(2)[None], cache, jnp.zeros((1,), jnp.int32),
            causal_mask(1, 2))
    flat, _ = runner.forward(*args)
    whole, _ = forward(runner.graphdef, runner.params, *args)  # the State itself still merges
    np.testing.assert_array_equal(np.asarray(flat), np.asarray(whole))
