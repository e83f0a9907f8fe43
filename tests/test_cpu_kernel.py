"""The CPU kernel (ssd_jax/kernels/cpu.py) against numpy's float64 products, and the packed
models it runs against the same models unpacked."""
from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ssd_jax.config import ModelConfig
from ssd_jax.core.runner import ModelRunner
from ssd_jax.kernels import cpu
from ssd_jax.models import causal_mask
from ssd_jax.models.packing import is_packed, pack_model, unpack_model
from ssd_jax.models.transformer import KVCache, Transformer

# A machine without a C++ compiler keeps XLA's products (the last test checks what it is told).
needs_kernel = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler on this machine")


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize("K,N", [(96, 64), (200, 192), (64, 129)])
def test_packed_product_matches_numpy(M, K, N):
    x, w = _rand(M, K), _rand(K, N, seed=1)
    got = np.asarray(cpu.packed_matmul(jnp.asarray(x), cpu.pack(jnp.asarray(w)), N))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(K))


@needs_kernel
def test_leading_dims_and_no_rows():
    x, w = _rand(2, 3, 64), _rand(64, 128, seed=1)
    got = np.asarray(cpu.packed_matmul(jnp.asarray(x), cpu.pack(jnp.asarray(w))))
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-4)
    assert cpu.packed_matmul(jnp.zeros((0, 64)), cpu.pack(jnp.asarray(w))).shape == (0, 128)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    # Verification scores K+1 tokens where AR scores one: the same bits keep greedy SD == AR.
    x, p = jnp.asarray(_rand(9, 320)), cpu.pack(jnp.asarray(_rand(320, 256, seed=1)))
    many = np.asarray(cpu.packed_matmul(x, p))
    for i in range(9):
        assert np.array_equal(np.asarray(cpu.packed_matmul(x[i:i + 1], p))[0], many[i])


@needs_kernel
def test_pack_layout_and_round_trip():
    w = jnp.asarray(_rand(5, 128))
    p = cpu.pack(w)
    assert p.shape == (2, 5, 64)
    assert float(p[1, 3, 7]) == float(w[3, 64 + 7])
    assert np.array_equal(np.asarray(cpu.unpack(p)), np.asarray(w))
    assert np.array_equal(np.asarray(cpu.pack_rows(w.T)), np.asarray(p))
    # A width that is not a multiple of 64 (a short-list head's 32768 + 1) is padded with zeros.
    odd = jnp.asarray(_rand(5, 70))
    assert cpu.pack(odd).shape == (2, 5, 64) and float(jnp.abs(cpu.pack(odd)[1, :, 6:]).max()) == 0
    assert np.array_equal(np.asarray(cpu.unpack(cpu.pack(odd), 70)), np.asarray(odd))
    assert np.array_equal(np.asarray(cpu.pack_rows(odd.T)), np.asarray(cpu.pack(odd)))
    assert cpu.packable(odd) and not cpu.packable(jnp.zeros((5, 64), jnp.bfloat16))


def _config(**kw):
    return ModelConfig(**dict(arch="qwen2", vocab_size=300, hidden_size=128, intermediate_size=192,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, **kw))


def _logits(model, T=5):
    c = model.config
    toks = jnp.asarray(np.random.default_rng(3).integers(0, c.vocab_size, (2, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    return np.asarray(model(toks, pos, KVCache.zeros(c, 2, 16), jnp.zeros((2,), jnp.int32),
                            causal_mask(2, T))[0])


@needs_kernel
@pytest.mark.parametrize("tied", [True, False])
def test_a_packed_model_gives_the_unpacked_models_logits(tied):
    model = Transformer(_config(tie_embeddings=tied), rngs=nnx.Rngs(0))
    want = _logits(model)
    kernels = {str(k): np.asarray(v[...]) for k, v in nnx.iter_graph(model)
               if isinstance(v, nnx.Param)}
    # q/k/v/o, gate/up/down per layer, and the head (tied: a packed copy of the embedding)
    assert pack_model(model) == 2 * 7 + 1 and is_packed(model)
    np.testing.assert_allclose(_logits(model), want, rtol=1e-4, atol=1e-4)
    unpack_model(model)
    assert not is_packed(model)
    again = {str(k): np.asarray(v[...]) for k, v in nnx.iter_graph(model)
             if isinstance(v, nnx.Param)}
    assert again.keys() == kernels.keys()
    assert all(np.array_equal(again[k], kernels[k]) for k in kernels)


@needs_kernel
def test_runner_packs_on_one_cpu_device_and_not_when_asked_not_to():
    model = Transformer(_config(), rngs=nnx.Rngs(0))
    assert not ModelRunner(model, cpu_kernels=False).packed and not is_packed(model)
    runner = ModelRunner(model)
    assert runner.packed and is_packed(model)
    assert ModelRunner(model, cpu_kernels=False).packed is False and not is_packed(model)


@needs_kernel
def test_a_model_packed_for_one_device_is_unpacked_for_a_tensor_parallel_mesh():
    script = """
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from ssd_jax.core.runner import ModelRunner
from ssd_jax.models import causal_mask
from ssd_jax.models.packing import is_packed
from tests.test_cpu_kernel import _config
from ssd_jax.models.transformer import Transformer
model = Transformer(_config(), rngs=nnx.Rngs(0))
one = ModelRunner(model, Mesh(np.array(jax.devices()[:1]), ("tp",)))
assert one.packed and is_packed(model)
two = ModelRunner(model, Mesh(np.array(jax.devices()[:2]), ("tp",)))
assert not two.packed and not is_packed(model)
toks = jnp.ones((1, 3), jnp.int32); pos = jnp.arange(3)[None]
out = [np.asarray(r.forward(toks, pos, r.new_cache(1, 16), jnp.zeros((1,), jnp.int32),
                            causal_mask(1, 3))[0]) for r in (one, two)]
np.testing.assert_allclose(out[0], out[1], rtol=1e-4, atol=1e-4)
print("ok")
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_a_missing_or_failing_compiler_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(cpu.KernelBuildError, match="no-such-c..' was not found: install g"):
        cpu.build(tmp_path / "k.so")
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(cpu.KernelBuildError, match="false could not compile cpu_matmul.cc"):
        cpu.build(tmp_path / "k.so")
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
