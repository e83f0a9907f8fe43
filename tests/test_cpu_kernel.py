"""The CPU kernel (ssd_jax/kernels/cpu.py) against numpy's float64 products, and the packed
models it runs against the same models unpacked; its bf16 form (a draft's) against the same
products of bf16-rounded inputs, and SD/SSD with a bf16 draft against AR and the target's
distribution."""
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
from ssd_jax.models.packing import is_packed, pack_model, packed_precision, unpack_model
from ssd_jax.models.transformer import KVCache, Transformer
from tests.test_ssd import vocab6  # noqa: F401  (fixture)

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
@pytest.mark.parametrize("M", [2, 4, 5, 8, 9])  # AVX2: 2-8 rows go by chunks of K, 9 by blocks
@pytest.mark.parametrize("K", [320, 200])  # 200: a last chunk shorter than the others
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(M, K):
    # Verification scores K+1 tokens where AR scores one: the same bits keep greedy SD == AR.
    x, p = jnp.asarray(_rand(M, K)), cpu.pack(jnp.asarray(_rand(K, 256, seed=1)))
    many = np.asarray(cpu.packed_matmul(x, p))
    for i in range(M):
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


def _bf16(a: np.ndarray) -> np.ndarray:
    """Round to bf16 (nearest even), back in float64: the bf16 form's inputs, exactly."""
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 6, 7, 13])
@pytest.mark.parametrize("K,N", [(96, 64), (200, 192), (64, 129)])
def test_bf16_form_matches_numpy_on_rounded_inputs(M, K, N):
    # Each product of two bf16 numbers is exact in fp32; only the fp32 sums round.
    x, w = _rand(M, K), _rand(K, N, seed=1)
    got = np.asarray(cpu.packed_matmul(jnp.asarray(x), cpu.pack(jnp.asarray(w), "bf16"), N))
    np.testing.assert_allclose(got, _bf16(x) @ _bf16(w), rtol=1e-5, atol=1e-5 * np.sqrt(K))
    # ... and far from the unrounded product: the inputs really were rounded.
    assert np.abs(got - x.astype(np.float64) @ w).max() > 1e-3


@needs_kernel
def test_bf16_form_layout_round_trip_and_row_independence():
    w = jnp.asarray(_rand(6, 70))
    p = cpu.pack(w, "bf16")
    assert p.shape == (2, 3, 64) and p.dtype == jnp.uint32 and cpu.precision_of(p) == "bf16"
    # Rows 2i (low half) and 2i+1 (high half) of a column share a word.
    word = int(p[1, 1, 5])
    assert (word & 0xFFFF) == int(jnp.asarray(w[2, 69]).astype(jnp.bfloat16).view(jnp.uint16))
    assert (word >> 16) == int(jnp.asarray(w[3, 69]).astype(jnp.bfloat16).view(jnp.uint16))
    assert np.array_equal(np.asarray(cpu.unpack(p, 70), np.float64), _bf16(np.asarray(w)))
    assert np.array_equal(np.asarray(cpu.pack_rows(w.T, "bf16")), np.asarray(p))
    assert not cpu.packable(jnp.zeros((5, 64)), "bf16")  # rows pair up: K must be even
    with pytest.raises(ValueError, match="precision='fp16' is unknown"):
        cpu.pack(w, "fp16")
    x = jnp.asarray(_rand(9, 320))
    p = cpu.pack(jnp.asarray(_rand(320, 256, seed=1)), "bf16")
    many = np.asarray(cpu.packed_matmul(x, p))
    for i in range(9):
        assert np.array_equal(np.asarray(cpu.packed_matmul(x[i:i + 1], p))[0], many[i])


_CONFIG = dict(arch="qwen2", vocab_size=300, hidden_size=128, intermediate_size=192, num_layers=2,
               num_heads=4, num_kv_heads=2, head_dim=32)


def _config(**kw):
    return ModelConfig(**_CONFIG, **kw)


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
def test_a_bf16_packed_model_is_close_to_fp32_and_repacks():
    model = Transformer(_config(tie_embeddings=True), rngs=nnx.Rngs(0))
    want = _logits(model)
    runner = ModelRunner(model, precision="bf16")
    assert runner.packed and packed_precision(model) == "bf16"
    got = _logits(model)
    assert not np.array_equal(got, want)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())
    # Asked for fp32 now, the model is repacked from its rounded weights.
    assert ModelRunner(model).packed and packed_precision(model) == "fp32"
    np.testing.assert_allclose(_logits(model), got, rtol=0.05, atol=0.05 * np.abs(want).max())


@needs_kernel
def test_a_model_packed_for_one_device_is_unpacked_for_a_tensor_parallel_mesh():
    script = """
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from ssd_jax.core.runner import ModelRunner
from ssd_jax.models import causal_mask
from ssd_jax.models.packing import is_packed
from ssd_jax.config import ModelConfig
from ssd_jax.models.transformer import Transformer
model = Transformer(ModelConfig(**%r), rngs=nnx.Rngs(0))
one = ModelRunner(model, Mesh(np.array(jax.devices()[:1]), ("tp",)))
assert one.packed and is_packed(model)
two = ModelRunner(model, Mesh(np.array(jax.devices()[:2]), ("tp",)))
assert not two.packed and not is_packed(model)
toks = jnp.ones((1, 3), jnp.int32); pos = jnp.arange(3)[None]
out = [np.asarray(r.forward(toks, pos, r.new_cache(1, 16), jnp.zeros((1,), jnp.int32),
                            causal_mask(1, 3))[0]) for r in (one, two)]
np.testing.assert_allclose(out[0], out[1], rtol=1e-4, atol=1e-4)
print("ok")
""" % _CONFIG
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


def _cpu_flags() -> list[str]:
    """This CPU's instruction-set flags (/proc/cpuinfo)."""
    from ssd_jax.xla_cpu import read_cpuinfo
    return next((ln for ln in read_cpuinfo().splitlines() if ln.startswith("flags")),
                "").split()


@needs_kernel
def test_the_kernel_is_built_for_the_vector_width_asked():
    import ctypes
    wide = "avx512f" in _cpu_flags() and "-mno-avx512f" not in os.environ.get(cpu.FLAGS_ENV, "")
    assert ctypes.CDLL(str(cpu.library_path())).SsdKernelLanes() == (16 if wide else 8)


@needs_kernel
@pytest.mark.parametrize("flag,needs", [("-mno-avx512f", "avx512f"),
                                        ("-mno-avx512bf16", "avx512_bf16")])
def test_the_other_forms_pass_the_product_tests(flag, needs, tmp_path):
    """The kernel's forms for other CPUs, built here and run through the tests above in a fresh
    process: AVX2 (no AVX-512: 8 floats a vector, one row a pass) and AVX-512 without
    AVX512-BF16 (the bf16 form's two fp32 products per pair, 16 floats a vector)."""
    if needs not in _cpu_flags():
        pytest.skip(f"no {needs} here: the default build is that form already")
    env = dict(os.environ, **{cpu.FLAGS_ENV: flag}, SSD_JAX_CACHE=str(tmp_path))
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", __file__, "-k",
         "matches_numpy or leading_dims or beside_it or round_trip or vector_width"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
    assert list((tmp_path / "kernels").rglob("cpu_matmul-*.so"))  # built apart from the default


# ---------------------------------------------------------------- SD/SSD with a bf16 draft

@needs_kernel
def test_greedy_with_a_bf16_draft_equals_the_targets_greedy(vocab6):  # noqa: F811
    """The bf16 draft (EngineConfig.draft_precision) is another draft: greedy SD and SSD
    give transformers' greedy tokens for the fp32 target (rows of different prompt lengths in
    one batch; the draft's proposals are bf16-rounded, so they are rejected more often, never
    kept wrongly). The SmolLM2 pair's run of this check is in `make test-slow`."""
    import torch
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    target, draft, hf_target = vocab6
    draft = nnx.clone(draft)  # packed in place: the module's other tests keep theirs
    prompts, n = [[1, 2, 3], [4, 0, 5, 2, 2, 1, 3]], 24
    want = []
    for p in prompts:  # transformers' forward, argmax by argmax (EOS is a token like any)
        seq = list(p)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(hf_target(torch.tensor([seq])).logits[0, -1].argmax()))
        want.append(seq[len(p):])
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=6),
              engine=EngineConfig(max_batch=2, max_seq_len=64, prefill_bucket=8,
                                  draft_precision="bf16"))
    for mode in ("sd", "ssd"):
        out = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True),
                           mode=mode, chat=False)
        assert [o.token_ids for o in out] == want, mode
        # The draft is both right and wrong: a rule that kept its tokens unchecked would fail.
        assert 0.0 < out[0].metrics.acceptance < 1.0, out[0].metrics.acceptance
    assert packed_precision(draft) == "bf16"


@needs_kernel
@pytest.mark.slow  # 2 min (the SmolLM2 pair compiled twice); the tiny pair's check runs above
@pytest.mark.parametrize("driver", ["single", "processes"])
def test_greedy_with_a_bf16_draft_equals_ar(driver):
    """The bf16 draft (EngineConfig.draft_precision) is another draft: greedy SD and SSD still
    give AR's tokens (AR with the fp32 target, in a separate LLM: nothing shared)."""
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    prompts = ["def fibonacci(n):", "Name three rivers of Europe."]
    p = SamplingParams(max_new_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in LLM("smollm2", engine=EngineConfig(
        max_batch=2, max_seq_len=256), progress=False).generate(prompts, p, mode="ar")]
    llm = LLM("smollm2", draft="smollm2-draft", spec=SpecConfig(k=3, budget=6),
              engine=EngineConfig(max_batch=2, max_seq_len=256, driver=driver,
                                  draft_precision="bf16"), progress=False)
    with llm:
        for mode in ("sd", "ssd"):
            out = llm.generate(prompts, p, mode=mode)
            assert [o.token_ids for o in out] == want, (driver, mode)
            assert out[0].metrics.acceptance > 0.0
        if driver == "single":
            assert llm.core.draft_runner.packed
            assert packed_precision(llm.core._draft()) == "bf16"
        else:
            assert "--draft-precision bf16" in " ".join(llm.core.pool.procs["draft"].args)


@needs_kernel
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampled_with_a_bf16_draft_follows_target(vocab6, mode):  # noqa: F811
    from ssd_jax import LLM, EngineConfig
    from ssd_jax.config import SpecConfig
    from tests.oracles import chi2_pvalue, exact_sequence_probs, sequence_counts
    from tests.test_ssd import N_OUT
    target, draft, hf_target = vocab6
    draft = nnx.clone(draft)  # packed in place: the module's other tests keep theirs
    llm = LLM(target, draft=draft, spec=SpecConfig(k=2, c=0.5, budget=4),
              engine=EngineConfig(max_batch=64, max_seq_len=64, prefill_bucket=8, sync_every=4,
                                  draft_precision="bf16"))
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0, N_OUT)
    counts = sequence_counts(llm, mode, N_OUT)
    assert packed_precision(draft) == "bf16"
    assert chi2_pvalue(counts, probs) > 1e-3
