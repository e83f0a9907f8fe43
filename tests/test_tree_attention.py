"""The Pallas tree-attention kernel against the jnp reference `attend`.

By default every case runs both lowerings with interpret=True on CPU. On a GPU or TPU machine,
SSD_PALLAS_INTERPRET=0 runs the same cases compiled (cases of the other lowering are skipped);
bench/gpu_check.sh does this. The switch is an env var because it belongs to this test file only.

Tolerances (max abs and rel error vs the reference, outputs are O(1)): fp32 1e-5; bf16 2e-2, since
the kernel feeds bf16 operands (and bf16 softmax weights) to the matmuls where the reference
upcasts everything to fp32, and the output itself is rounded to bf16 (2^-8 relative).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import tree_attention
from ssd_jax.models.attention import attend, select_attention

INTERPRET = os.environ.get("SSD_PALLAS_INTERPRET", "1") != "0"
PLATFORM = {"cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), jax.default_backend())
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "tree" (random parents), "chain" (causal), "decode" (T=U=1)
    B: int
    T: int
    Hq: int
    Hkv: int
    D: int
    S: int
    prefix: tuple[int, ...]
    dtype: str = "float32"
    block_kv: int | None = 16
    kv_splits: int | None = None  # GPU lowering only; None = the kernel's heuristic

    def __str__(self):
        return (f"{self.kind}-B{self.B}-T{self.T}-G{self.Hq // self.Hkv}-D{self.D}-S{self.S}-"
                f"p{'_'.join(map(str, self.prefix))}-{self.dtype}-bk{self.block_kv}"
                + (f"-split{self.kv_splits}" if self.kv_splits else ""))


def tree_mask(rng: np.random.Generator, n: int) -> np.ndarray:
    """Token u sees itself and its ancestors; parent[u] is uniform over {root, 0..u-1}."""
    parent = [-1] + [int(rng.integers(-1, u)) for u in range(1, n)]
    m = np.zeros((n, n), bool)
    for u in range(n):
        a = u
        while a >= 0:
            m[u, a] = True
            a = parent[a]
    return m


def make_inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    B, T, Hq, Hkv, D, S = case.B, case.T, case.Hq, case.Hkv, case.D, case.S
    assert len(case.prefix) == B and max(case.prefix) <= S
    if case.kind == "tree":
        mask = np.stack([tree_mask(rng, T) for _ in range(B)])
    else:
        mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
    cache_k, cache_v = rng.standard_normal((2, B, S, Hkv, D))
    # Slots past prefix_len hold stale K/V from rejected speculation: make them large, so a
    # kernel that reads them (a wrong length mask on the last, partial block) fails loudly.
    stale = np.arange(S)[None, :] >= np.array(case.prefix)[:, None]
    cache_k[stale] *= 30.0
    cache_v[stale] *= 30.0
    cache_k, cache_v = cache_k.transpose(0, 2, 1, 3), cache_v.transpose(0, 2, 1, 3)  # [B,Hkv,S,D]
    dt = jnp.dtype(case.dtype)
    arr = lambda x: jnp.asarray(x, dt)
    return (arr(rng.standard_normal((B, T, Hq, D))), arr(cache_k), arr(cache_v),
            jnp.asarray(case.prefix, jnp.int32), arr(rng.standard_normal((B, T, Hkv, D))),
            arr(rng.standard_normal((B, T, Hkv, D))), jnp.asarray(mask))


def check(case: Case, backend: str):
    if not INTERPRET and PLATFORM != backend:
        pytest.skip(f"compiled {backend} lowering needs a {backend}, this is {PLATFORM}")
    args = make_inputs(case)
    kernel = jax.jit(functools.partial(tree_attention, backend=backend, interpret=INTERPRET,
                                       block_kv=case.block_kv, kv_splits=case.kv_splits))
    out = np.asarray(kernel(*args).astype(jnp.float32))
    # The reference in IEEE fp32: XLA's default fp32 dot on a GPU is TF32 (~1e-3 error), which
    # failed every fp32 case on an H200 while the kernel (Precision.HIGHEST) was the exact side.
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(jax.jit(attend)(*args).astype(jnp.float32))
    assert out.shape == (case.B, case.T, case.Hq, case.D)
    tol = TOL[case.dtype]
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


GPU_CASES = [
    # Random trees: GQA 1/3/8, head_dim 64/128, per-row prefixes not multiples of block_kv=16.
    Case("tree", 2, 8, 2, 2, 64, 48, (37, 0)),
    Case("tree", 2, 6, 6, 2, 128, 40, (40, 23)),  # S=40 is padded to the block
    Case("tree", 2, 7, 8, 1, 64, 32, (5, 31), "bfloat16"),
    Case("tree", 1, 8, 3, 1, 128, 64, (50,), "bfloat16"),
    Case("tree", 2, 5, 6, 2, 64, 32, (0, 0)),  # empty prefix: only the new-token block
    # 40 tokens x G=3 = 120 query rows (two row blocks) and 40 new tokens (three 16-blocks + pad).
    Case("tree", 1, 40, 3, 1, 64, 64, (45,)),
    # Chains (causal mask): prefill / SD verification.
    Case("chain", 2, 5, 2, 2, 128, 64, (17, 63)),
    Case("chain", 3, 4, 8, 1, 64, 32, (0, 1, 30)),
    Case("chain", 2, 3, 3, 1, 64, 48, (33, 9), "bfloat16"),
    Case("chain", 2, 3, 6, 2, 64, 200, (150, 77), block_kv=None),  # default block, padded S
    # Single-token decode.
    Case("decode", 3, 1, 2, 2, 64, 48, (1, 16, 47)),
    Case("decode", 2, 1, 8, 1, 128, 48, (33, 0)),
    Case("decode", 2, 1, 6, 2, 64, 32, (19, 32), "bfloat16"),
    # Split-KV (flash-decoding) partials merged by log-sum-exp: splits wholly past a short
    # prefix, a row with no prefix at all, and 5 splits over 7 blocks (the last split empty).
    Case("tree", 2, 6, 6, 2, 64, 96, (90, 7), kv_splits=3),
    Case("decode", 2, 1, 8, 1, 128, 64, (0, 50), "bfloat16", kv_splits=4),
    Case("chain", 1, 4, 3, 1, 64, 112, (111,), kv_splits=5),
]

# The TPU interpreter simulates memory and DMAs (~100x slower): tiny shapes, block_kv=8.
TPU_CASES = [
    Case("tree", 2, 4, 3, 1, 64, 24, (13, 0), block_kv=8),
    Case("decode", 1, 1, 2, 2, 128, 16, (9,), "bfloat16", block_kv=8),
    Case("chain", 1, 3, 8, 1, 64, 16, (16,), block_kv=8),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_lowering_matches_reference(case):
    check(case, "gpu")


@pytest.mark.parametrize("case", TPU_CASES, ids=str)
def test_tpu_lowering_matches_reference(case):
    check(case, "tpu")


def test_tree_mask_is_a_tree():
    """The oracle's own input: every token sees itself, its parent's row is a subset of its row,
    and (for this seed) the tree branches, so it is not a chain in disguise."""
    m = tree_mask(np.random.default_rng(0), 12)
    assert m.diagonal().all() and not np.triu(m, 1).any()
    assert (m.sum(1) < np.arange(1, 13)).any()


@pytest.mark.parametrize("backend,platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_lowers_for_accelerator(backend, platform):
    """Cross-lower for the real device without one: runs every Triton / Mosaic lowering rule of
    the kernel (not the device compiler), so an unsupported op fails here, not on the machine."""
    case = Case("tree", 2, 8, 6, 2, 128, 256, (200, 3), "bfloat16", block_kv=128)
    args = make_inputs(case)
    f = jax.jit(functools.partial(tree_attention, backend=backend, block_kv=case.block_kv))
    text = f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert ("xla.gpu.triton" in text or "triton_kernel_call" in text) if backend == "gpu" \
        else "tpu_custom_call" in text


@pytest.mark.parametrize("platform", ["gpu", "cuda", "tpu"])
def test_select_attention_picks_kernel_on_accelerators(platform):
    expected = "tpu" if platform == "tpu" else "gpu"
    for name in ("auto", "pallas"):
        fn = select_attention(name, platform)
        assert isinstance(fn, functools.partial) and fn.func is tree_attention
        assert fn.keywords == {"backend": expected}
    assert select_attention("jnp", platform) is attend


def test_select_attention_cpu_and_errors():
    assert select_attention("auto", "cpu") is attend
    assert select_attention("jnp", "cpu") is attend
    for platform in ("cpu", "gpu", "tpu"):  # the GPU program, interpreted, wherever asked
        fn = select_attention("pallas-interpret", platform)
        assert isinstance(fn, functools.partial) and fn.func is tree_attention
        assert fn.keywords == {"backend": "gpu", "interpret": True}
    with pytest.raises(ValueError, match="needs a GPU or TPU"):
        select_attention("pallas", "cpu")
    with pytest.raises(ValueError, match="'auto', 'jnp', 'pallas', 'pallas-interpret'"):
        select_attention("triton", "gpu")


def test_rejects_bad_arguments():
    args = make_inputs(Case("chain", 1, 2, 4, 2, 64, 16, (4,)))
    with pytest.raises(ValueError, match="backend='cuda' is unknown"):
        tree_attention(*args, backend="cuda", interpret=True)
    q, cache_k, cache_v, prefix_len, new_k, new_v, mask = args
    with pytest.raises(ValueError, match="Hq=3 is not a multiple of Hkv=2"):
        tree_attention(q[:, :, :3], cache_k, cache_v, prefix_len, new_k, new_v, mask,
                       backend="gpu", interpret=True)
    with pytest.raises(ValueError, match="block_kv=12 is not a multiple of 8"):
        tree_attention(*args, backend="tpu", interpret=True, block_kv=12)


@pytest.mark.skipif(PLATFORM != "cpu", reason="checks what the selection gives on CPU")
def test_selected_attention_on_cpu():
    args = make_inputs(Case("tree", 1, 3, 2, 1, 64, 16, (5,)))
    want = jax.jit(attend)(*args)
    assert select_attention() is attend  # "auto" on this platform
    kernel = functools.partial(select_attention("pallas-interpret"), block_kv=16)
    np.testing.assert_allclose(jax.jit(kernel)(*args), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs a GPU or TPU, not 'cpu'"):
        select_attention("pallas")
