"""Our NNX models against transformers on tiny random Llama-3 (rope scaling), Qwen2 (q/k/v biases,
GQA, tied and untied) and Qwen3 models."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ssd_jax.loading import load
from ssd_jax.models import KVCache, causal_mask, commit
from ssd_jax.core.runner import ModelRunner


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.fixture(params=["tiny_llama", "tiny_qwen2", "tiny_qwen2_untied", "tiny_qwen3"])
def pair(request):
    path, hf_model = request.getfixturevalue(request.param)
    model, _, _ = load(path)
    return model, hf_model


def test_prefill_logits_match_transformers(pair):
    model, hf_model = pair
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, size=(2, 21))
    runner = ModelRunner(model)
    B, T = ids.shape
    cache = runner.new_cache(B, 64)
    logits, _ = runner.forward(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(T), (B, T)), cache,
                               jnp.zeros((B,), jnp.int32), causal_mask(B, T))
    np.testing.assert_allclose(np.asarray(logits), _torch_logits(hf_model, ids), atol=1e-4, rtol=0)


def test_decode_through_cache_matches_transformers(pair):
    """Prefill a prompt, then feed tokens one at a time through commit + cache; rows have
    different prompt lengths, so the per-row prefix masks are exercised."""
    model, hf_model = pair
    rng = np.random.default_rng(1)
    full = rng.integers(0, 128, size=(2, 30))
    lens = np.array([7, 12])
    runner = ModelRunner(model)
    cache = runner.new_cache(2, 64)
    T = 12
    tokens = np.where(np.arange(T) < lens[:, None], full[:, :T], 0)
    _, new_kv = runner.forward(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), (2, T)), cache,
                               jnp.zeros((2,), jnp.int32), causal_mask(2, T))
    cache = commit(cache, new_kv, jnp.zeros((2,), jnp.int32))
    length = jnp.asarray(lens)
    ours = [[], []]
    for _ in range(14):
        tok = full[np.arange(2), np.asarray(length)]
        logits, new_kv = runner.forward(jnp.asarray(tok)[:, None], length[:, None], cache, length,
                                        jnp.ones((2, 1, 1), bool))
        cache = commit(cache, new_kv, length)
        for b in range(2):
            ours[b].append(np.asarray(logits[b, 0]))
        length = length + 1
    for b in range(2):
        ref = _torch_logits(hf_model, full[b:b + 1, :lens[b] + 14])[0, lens[b]:]
        np.testing.assert_allclose(np.stack(ours[b]), ref, atol=1e-4, rtol=0)


def test_multi_token_step_after_prefix_matches(pair):
    """An SD-style verify: 5 new tokens under a chain mask after a committed prefix."""
    model, hf_model = pair
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 128, size=(1, 16))
    runner = ModelRunner(model)
    cache = runner.new_cache(1, 64)
    _, kv = runner.forward(jnp.asarray(ids[:, :11]), jnp.arange(11)[None], cache,
                           jnp.zeros((1,), jnp.int32), causal_mask(1, 11))
    cache = commit(cache, kv, jnp.zeros((1,), jnp.int32))
    logits, _ = runner.forward(jnp.asarray(ids[:, 11:]), jnp.arange(11, 16)[None], cache,
                               jnp.array([11]), causal_mask(1, 5))
    np.testing.assert_allclose(np.asarray(logits[0]), _torch_logits(hf_model, ids)[0, 11:],
                               atol=1e-4, rtol=0)


def test_bf16_model_is_close_to_fp32(tiny_llama):
    path, hf_model = tiny_llama
    model, _, _ = load(path, dtype="bfloat16")
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    ids = np.random.default_rng(3).integers(0, 128, size=(1, 9))
    runner = ModelRunner(model)
    logits, _ = runner.forward(jnp.asarray(ids), jnp.arange(9)[None], runner.new_cache(1, 16),
                               jnp.zeros((1,), jnp.int32), causal_mask(1, 9))
    ref = _torch_logits(hf_model, ids)
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_allclose(np.asarray(logits), ref, atol=0.15, rtol=0)


def test_cache_zeros_shape(tiny_qwen3):
    model, _, _ = load(tiny_qwen3[0])
    cache = KVCache.zeros(model.config, 3, 40)
    assert len(cache.k) == 2 and cache.k[0].shape == (3, 1, 40, 32)  # [B, Hkv, S, D]


def test_qwen2_biases_are_loaded(tiny_qwen2):
    """The fixture's biases are non-zero and land in the q/k/v projections."""
    model, _, _ = load(tiny_qwen2[0])
    hf_bias = tiny_qwen2[1].model.layers[1].self_attn.k_proj.bias.detach().numpy()
    assert np.abs(hf_bias).max() > 0.1
    np.testing.assert_array_equal(np.asarray(model.layers[1].self_attn.k_proj.bias[...]), hf_bias)
    assert model.layers[0].mlp.up_proj.bias is None
