"""The attention primitive as a flash-style Pallas kernel, for GPU (Triton) and TPU (Mosaic).

    tree_attention(q[B,T,Hq,D], cache_k/v[B,Hkv,S,D], prefix_len[B], new_k/v[B,U,Hkv,D],
                   mask[B,T,U]) -> [B,T,Hq,D]

Same contract as `ssd_jax.models.attention.attend` (the reference it is tested against): queries
see cache slots < prefix_len[b] and the new tokens their mask row allows. One online softmax runs
over KV blocks of the prefix and then over the new-token block(s) under the mask, accumulating in
fp32 whatever the input dtype.

Layout. Grouped-query heads are folded into query rows: for KV head h the kernel processes the
R = T*G rows (t, g) of the query heads that share h, so each K/V block is read once per group
instead of once per query head; decode (T=1) becomes a G-row matmul instead of a matrix-vector
product. Only q, new K/V and the mask (all of size ~T) are transposed in the wrapper; the cache is
read in place (any re-layout would cost a full copy per layer), and its head-major [B,Hkv,S,D]
layout makes each head's slots one contiguous [S, D] slab.

Rows whose mask and prefix are both empty (batch padding) get a finite but unspecified value, as
in the reference; the reference averages over the stale cache too, so the two differ only there.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.models.attention import MASK_VALUE

LOWERINGS = ("gpu", "tpu")
# Per-lowering default KV block: Triton keeps a [block_kv, D] K and V tile plus the score tile in
# registers/shared memory, so small blocks; Mosaic DMAs whole blocks into VMEM, where bigger blocks
# amortise the ~0.35 us per-grid-step overhead.
DEFAULT_BLOCK_KV = {"gpu": 64, "tpu": 512}
# Query rows per Triton program: T*G can reach several hundred (64-token trees, G=8), which would
# not fit an fp32 accumulator in registers; 64 rows x 128 lanes does.
_GPU_BLOCK_ROWS = 64
# Triton's tl.dot needs every matmul dimension >= 16 and every tensor a power of two in size.
_TRITON_MIN = 16


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _online_update(q, k, v, valid, acc, m, l, *, scale: float, precision):
    """One flash-attention step: fold the keys/values of one block into (acc, m, l).

    q [R, D], k/v [N, D], valid [R or 1, N]; acc [R, D], m/l [R, 1] all fp32. Masked scores use
    the reference's finite MASK_VALUE rather than -inf, so a row whose first block is entirely
    masked never computes inf - inf; once a real score arrives, exp(MASK_VALUE - m) = 0 wipes it.
    """
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    # p is cast to V's dtype for the MXU/tensor-core matmul (bf16 x bf16 -> fp32 accumulate), the
    # usual flash-attention trade: p in [0, 1] loses < 2^-8 relative, far inside bf16 tolerance.
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return alpha * acc + pv, m_new, l_new


def _precision(dtype):
    # Triton's default for fp32 dots is TF32 (10-bit mantissa, ~1e-3 error); the fp32 path must
    # match the reference to ~1e-5, so ask for IEEE fp32. bf16 inputs are exact in either mode.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _gpu_kernel(len_ref, q_ref, k_ref, v_ref, nk_ref, nv_ref, mask_ref, acc_ref, m_ref, l_ref,
                *, scale: float, block_kv: int, block_u: int, blocks_per_split: int):
    # Refs: len (), q [Rb, D], k/v [S, D] (one KV head, contiguous in HBM), nk/nv [Up, D],
    # mask [Rb, Up] int32; out acc [Rb, D], m/l [Rb, 1] (fp32, unnormalised, merged by _merge).
    # One program per (batch row, KV head, block of query rows, split of the cache).
    q = q_ref[...]
    rows, d = q.shape
    precision = _precision(q.dtype)
    n = len_ref[...]
    split, num_splits = pl.program_id(3), pl.num_programs(3)
    update = functools.partial(_online_update, scale=scale, precision=precision)
    carry = (jnp.zeros((rows, d), jnp.float32),
             jnp.full((rows, 1), -jnp.inf, jnp.float32),
             jnp.zeros((rows, 1), jnp.float32))

    def prefix_block(i, carry):
        start = i * block_kv
        cols = start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        blk = pl.ds(pl.multiple_of(start, block_kv), block_kv)
        return update(q, k_ref[blk, :], v_ref[blk, :], cols < n, *carry)

    # Dynamic trip count: blocks past prefix_len[b] are never loaded, so a short row in a batch
    # with a long cache costs only its own length (a split wholly past it runs zero iterations).
    # Only the last block is partial, but masking every block is one select per score and keeps
    # the loop body single.
    lo = split * blocks_per_split
    hi = jnp.minimum(lo + blocks_per_split, pl.cdiv(n, block_kv))
    carry = lax.fori_loop(lo, hi, prefix_block, carry)

    def new_block(j, carry):
        blk = pl.ds(pl.multiple_of(j * block_u, block_u), block_u)
        return update(q, nk_ref[blk, :], nv_ref[blk, :], mask_ref[:, blk] != 0, *carry)

    # The new tokens belong to the last split only; a zero trip count elsewhere avoids a branch.
    # Integer arithmetic, not jnp.where: jax 0.11.2's Triton lowering typed a scalar select of two
    # ints as i1, and scf.for rejected the i1 trip count (seen on an H200). split <= last, so
    # max(0, split - last + 1) is 1 on the last split and 0 elsewhere.
    is_last = jnp.maximum(split - (num_splits - 1) + 1, 0)
    num_new = is_last * (nk_ref.shape[0] // block_u)
    acc_ref[...], m_ref[...], l_ref[...] = lax.fori_loop(0, num_new, new_block, carry)


def _merge(acc, m, l):
    """Combine per-split softmax partials [..., splits, R, *] by their maxima (log-sum-exp).

    The last split always holds the new tokens, so its m is finite (>= MASK_VALUE) and the
    global max is finite; empty splits (m = -inf, l = 0) get weight exactly 0, never NaN."""
    m_all = jnp.max(m, axis=-3, keepdims=True)
    w = jnp.exp(m - m_all)
    return jnp.sum(w * acc, axis=-3) / jnp.sum(w * l, axis=-3)


def _default_kv_splits(programs: int, num_blocks: int) -> int:
    # Flash-decoding: with B * Hkv * row-blocks programs alone, batch-1 decode runs ~8 programs
    # on a 132-SM H200, each streaming the whole prefix. Split the cache until there are ~2
    # programs per SM, keeping >= 4 blocks per split so the merge stays negligible.
    return max(1, min(pl.cdiv(256, programs), num_blocks // 4))


def _tpu_kernel(len_ref, q_ref, k_ref, v_ref, nk_ref, nv_ref, mask_ref, o_ref,
                acc_ref, m_ref, l_ref, *, scale: float, block_kv: int, num_kv_heads: int):
    # Refs: len [B] (SMEM, scalar-prefetched), q [Hkv, R, D], k/v [Hkv, block_kv, D] (one block of
    # the cache, all heads; a (block_kv, D) tile per head is legal in Mosaic since D is the full
    # last dimension), nk/nv [Hkv, U, D], mask [R, U], o [Hkv, R, D]; scratch acc [Hkv, R, D],
    # m/l [Hkv, R, 1]. Grid (B, num_blocks): the last axis walks the cache sequentially.
    b, i = pl.program_id(0), pl.program_id(1)
    n = len_ref[b]
    precision = _precision(q_ref.dtype)
    update = functools.partial(_online_update, scale=scale, precision=precision)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    def step(h, k, v, valid):
        acc, m, l = update(q_ref[h], k, v, valid, acc_ref[h], m_ref[h], l_ref[h])
        acc_ref[h], m_ref[h], l_ref[h] = acc, m, l

    # Blocks past prefix_len[b] skip compute here, and their index_map (below) repeats the last
    # valid block, so the pipeline issues no DMA for them either.
    @pl.when(i * block_kv < n)
    def _prefix():
        valid = (i * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)) < n
        for h in range(num_kv_heads):
            step(h, k_ref[h], v_ref[h], valid)

    @pl.when(i == pl.num_programs(1) - 1)
    def _new_tokens_and_finish():
        valid = mask_ref[...] != 0
        for h in range(num_kv_heads):
            step(h, nk_ref[h], nv_ref[h], valid)
            o_ref[h] = (acc_ref[h] / l_ref[h]).astype(o_ref.dtype)


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _pad_cache(cache_k, cache_v, block_kv: int):
    """Pad S to a multiple of block_kv. This copies the cache (once per call), so callers should
    bucket S to a multiple of the block, as the engine's cache buckets are; the padded slots lie
    beyond every prefix_len and are masked."""
    s_pad = pl.cdiv(cache_k.shape[2], block_kv) * block_kv
    return _pad_axis(cache_k, 2, s_pad), _pad_axis(cache_v, 2, s_pad)


def _gpu_call(qr, cache_k, cache_v, prefix_len, nk, nv, rmask, *, scale, block_kv, kv_splits,
              interpret):
    B, Hkv, R, D = qr.shape
    if D != _next_pow2(D) or D < _TRITON_MIN:
        raise ValueError(f"head_dim={D} is unsupported by the Triton lowering: it needs a power "
                         f"of two >= {_TRITON_MIN} (use backend='tpu' or the jnp attend)")
    # Triton blocks are powers of two >= 16; no bigger than the (rounded-up) cache.
    block_kv = max(_TRITON_MIN, min(_next_pow2(block_kv), _next_pow2(cache_k.shape[2])))
    cache_k, cache_v = _pad_cache(cache_k, cache_v, block_kv)
    S = cache_k.shape[2]
    block_r = min(_GPU_BLOCK_ROWS, max(_TRITON_MIN, _next_pow2(R)))
    rp = pl.cdiv(R, block_r) * block_r
    up = max(_TRITON_MIN, _next_pow2(nk.shape[2]))
    block_u = min(up, block_kv)
    num_blocks = S // block_kv
    if kv_splits is None:
        kv_splits = _default_kv_splits(B * Hkv * (rp // block_r), num_blocks)
    kv_splits = max(1, min(kv_splits, num_blocks))
    blocks_per_split = pl.cdiv(num_blocks, kv_splits)
    # Padded rows/new tokens are masked out (mask 0) and sliced off the output.
    qr = _pad_axis(qr, 2, rp)
    nk, nv = _pad_axis(nk, 2, up), _pad_axis(nv, 2, up)
    rmask = _pad_axis(_pad_axis(rmask, 1, rp), 2, up)
    kernel = functools.partial(_gpu_kernel, scale=scale, block_kv=block_kv, block_u=block_u,
                               blocks_per_split=blocks_per_split)
    part = lambda *last: pl.BlockSpec((None, None, None, block_r, *last),
                                      lambda b, h, r, s: (b, h, s, r, 0))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(B, Hkv, rp // block_r, kv_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, r, s: (b,)),
            pl.BlockSpec((None, None, block_r, D), lambda b, h, r, s: (b, h, r, 0)),
            pl.BlockSpec((None, None, S, D), lambda b, h, r, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, S, D), lambda b, h, r, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, up, D), lambda b, h, r, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, up, D), lambda b, h, r, s: (b, h, 0, 0)),
            pl.BlockSpec((None, block_r, up), lambda b, h, r, s: (b, r, 0)),
        ],
        out_specs=[part(D), part(1), part(1)],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, kv_splits, rp, d), jnp.float32)
                   for d in (D, 1, 1)],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="tree_attention_gpu",
    )(prefix_len, qr, cache_k, cache_v, nk, nv, rmask)
    return _merge(acc, m, l)[:, :, :R].astype(qr.dtype)


def _tpu_call(qr, cache_k, cache_v, prefix_len, nk, nv, rmask, *, scale, block_kv, kv_splits,
              interpret):
    del kv_splits  # The TPU grid runs sequentially per core; splitting buys no parallelism.
    B, Hkv, R, D = qr.shape
    U = nk.shape[2]
    # Mosaic tiles are (8, 128): a block of cache rows is a multiple of 8 or the whole cache.
    if block_kv >= cache_k.shape[2]:
        block_kv = cache_k.shape[2]
    elif block_kv % 8:
        raise ValueError(f"block_kv={block_kv} is not a multiple of 8, as Mosaic needs for a "
                         f"cache of {cache_k.shape[2]} slots: pass a multiple of 8")
    cache_k, cache_v = _pad_cache(cache_k, cache_v, block_kv)
    S = cache_k.shape[2]

    def kv_map(b, i, lens):
        last = jnp.maximum(pl.cdiv(lens[b], block_kv) - 1, 0)
        return b, 0, jnp.minimum(i, last), 0

    full = lambda *shape: pl.BlockSpec((None, *shape), lambda b, i, lens: (b,) + (0,) * len(shape))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, S // block_kv),
        in_specs=[full(Hkv, R, D),
                  pl.BlockSpec((None, Hkv, block_kv, D), kv_map),
                  pl.BlockSpec((None, Hkv, block_kv, D), kv_map),
                  full(Hkv, U, D), full(Hkv, U, D), full(R, U)],
        out_specs=full(Hkv, R, D),
        scratch_shapes=[pltpu.VMEM((Hkv, R, D), jnp.float32),
                        pltpu.VMEM((Hkv, R, 1), jnp.float32),
                        pltpu.VMEM((Hkv, R, 1), jnp.float32)],
    )
    kernel = functools.partial(_tpu_kernel, scale=scale, block_kv=block_kv, num_kv_heads=Hkv)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qr.shape, qr.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        # The TPU interpreter (unlike the generic one) simulates scalar prefetch, SMEM/VMEM and
        # the DMA pipeline, so it checks this kernel's index maps as Mosaic would run them.
        interpret=pltpu.InterpretParams() if interpret else False,
        name="tree_attention_tpu",
    )(prefix_len, qr, cache_k, cache_v, nk, nv, rmask)


@functools.partial(jax.jit,
                   static_argnames=("scale", "backend", "interpret", "block_kv", "kv_splits"))
def tree_attention(
    q: Float[Array, "B T Hq D"],
    cache_k: Float[Array, "B Hkv S D"],
    cache_v: Float[Array, "B Hkv S D"],
    prefix_len: Int[Array, " B"],
    new_k: Float[Array, "B U Hkv D"],
    new_v: Float[Array, "B U Hkv D"],
    mask: Bool[Array, "B T U"],
    *,
    scale: float | None = None,
    backend: str,
    interpret: bool = False,
    block_kv: int | None = None,
    kv_splits: int | None = None,
) -> Float[Array, "B T Hq D"]:
    """`attend` as one Pallas kernel. backend: the lowering, "gpu" (Triton) or "tpu" (Mosaic),
    chosen by the caller (for the models: `ssd_jax.models.attention.select_attention`);
    interpret=True runs either lowering on CPU. block_kv: cache slots per step (default per
    backend, DEFAULT_BLOCK_KV). kv_splits (GPU only): programs the cache is split across per
    (row, head), merged by log-sum-exp; default from the grid size."""
    B, T, Hq, D = q.shape
    Hkv, U = cache_k.shape[1], new_k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}: grouped-query attention "
                         f"needs whole groups")
    if mask.shape != (B, T, U):
        raise ValueError(f"mask has shape {mask.shape}, expected (B, T, U)={(B, T, U)}")
    if backend not in LOWERINGS:
        raise ValueError(f"backend={backend!r} is unknown: use one of {LOWERINGS}")
    block_kv = DEFAULT_BLOCK_KV[backend] if block_kv is None else block_kv
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    # Row r = t*G + g of KV head h is query head h*G + g at token t (jnp.repeat below agrees).
    qr = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)
    rmask = jnp.repeat(mask.astype(jnp.int32), G, axis=1)  # int32: Triton/Mosaic load bool badly
    nk = new_k.astype(q.dtype).transpose(0, 2, 1, 3)
    nv = new_v.astype(q.dtype).transpose(0, 2, 1, 3)
    call = _gpu_call if backend == "gpu" else _tpu_call
    out = call(qr, cache_k.astype(q.dtype), cache_v.astype(q.dtype),
               prefix_len.astype(jnp.int32), nk, nv, rmask,
               scale=scale, block_kv=block_kv, kv_splits=kv_splits, interpret=interpret)
    return out.reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
