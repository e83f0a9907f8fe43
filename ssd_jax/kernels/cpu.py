"""fp32 products over a few rows on a CPU, from ssd-jax's own kernel (cpu_matmul.cc).

Decoding on a CPU multiplies 1-8 rows (a decode step, verifying K+1 tokens, a tree step over a
few branches) by every weight matrix. XLA:CPU gives products over more than one row to Eigen's
GEMM, which repacks the weight matrix on every call: one [5,1536] x [1536,8960] product took
4.8 ms against 2.1 ms for one row, and a tied LM head's [5,1536] x [1536,151936] 133 ms against
34 ms. Speculative decoding lives on that ratio. The kernel streams a weight matrix once for up
to 6 rows from a layout packed once at load time ([N/64, K, 64]: each 64-column block's rows
contiguous): 1.4-1.7 ms for one row, 1.8-2.0 ms for five (one vCPU, AVX-512). A prefill's
hundreds of rows run at about XLA's speed (512 rows: 146 against 131 ms). The column blocks are
split over XLA's intra-op threads (one when the process is pinned to a core).

The kernel is compiled from its C++ source by the machine's C++ compiler (`$CXX`, else c++ or
g++) at first use, for this CPU (-march=native), into the model cache; a machine without one
keeps XLA's products and is told so once. $SSD_JAX_KERNEL_FLAGS adds compiler flags after
-march=native (the tests build the AVX2 form on an AVX-512 machine with -mno-avx512f).
"""
from __future__ import annotations

import ctypes
import functools
from functools import partial
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

log = logging.getLogger(__name__)

BLOCK = 64  # columns per packed block (cpu_matmul.cc's kBlock)
SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "ssd_packed_matmul"
TARGET_BF16 = "ssd_packed_matmul_bf16"  # the bf16 form (pack(w, "bf16"))
FLAGS_ENV = "SSD_JAX_KERNEL_FLAGS"  # extra compiler flags, part of the build's cache key
PRECISIONS = ("fp32", "bf16")


class KernelBuildError(RuntimeError):
    pass


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else c++ or g++ on the PATH."""
    named = os.environ.get("CXX")
    return named or shutil.which("c++") or shutil.which("g++")


def build_key() -> str:
    """A short name for this source, jax version and compiler flags: a build of the kernel,
    and the step costs measured with it (autotune's store)."""
    return hashlib.sha1(SOURCE.read_bytes() + jax.__version__.encode()
                        + os.environ.get(FLAGS_ENV, "").encode()).hexdigest()[:12]


def library_path(cache: Path | None = None) -> Path:
    """Where this source, jax version and CPU's build is kept."""
    from ssd_jax.compile_cache import cpu_fingerprint
    from ssd_jax.loading.packaged import DEFAULT_CACHE
    return (Path(cache or DEFAULT_CACHE) / "kernels" / cpu_fingerprint()
            / f"cpu_matmul-{build_key()}.so")


def build(out: Path) -> Path:
    """Compile the kernel to `out` (atomically: workers starting together may both build)."""
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found: install g++ or set CXX")
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # as the compilation cache
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", *os.environ.get(FLAGS_ENV, "").split(), "-std=c++17",
           "-shared", "-fPIC", "-w", "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except FileNotFoundError:
            raise KernelBuildError(f"the C++ compiler {cxx!r} was not found: install g++ or "
                                   "set CXX") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise KernelBuildError(f"{cxx} could not compile {SOURCE.name}: {last}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA (built now if needed). False, with
    one warning that says why, where it cannot be."""
    try:
        path = library_path()
        if not path.exists():
            log.info("building ssd-jax's CPU kernel (once per machine): %s", path)
            build(path)
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SsdPackedMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(TARGET_BF16, jax.ffi.pycapsule(lib.SsdPackedMatmulBf16),
                                    platform="cpu")
        return True
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        log.warning("ssd-jax's CPU kernel is unavailable (%s); products over a few rows use "
                    "XLA's, which makes verification 2-3x slower on a CPU", e)
        return False


def packable(w: jax.Array, precision: str = "fp32", rows: bool = False) -> bool:
    """Whether a [K, N] fp32 weight (rows=True: an [N, K] one for pack_rows) can take the
    packed layout (the bf16 form pairs rows: K even)."""
    _check(precision)
    return (w.ndim == 2 and w.dtype == jnp.float32
            and (precision == "fp32" or w.shape[1 if rows else 0] % 2 == 0))


def _check(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown: use one of "
                         f"{', '.join(PRECISIONS)}")


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _pairs(a: Array) -> Array:
    """[..., 2] fp32 -> [...] uint32: the two rounded to bf16, the first in the low half."""
    return jax.lax.bitcast_convert_type(a.astype(jnp.bfloat16), jnp.uint32)


@partial(jax.jit, static_argnames="precision")
def pack(w: Float[Array, "K N"], precision: str = "fp32") -> Shaped[Array, "NB _ 64"]:
    """[K, N] -> [ceil(N / 64), K, 64]: block b holds columns 64b..64b+63, row by row; the
    last block is padded with zero columns (a short-list head has 32768 + 1). The bf16 form
    rounds each weight to bf16 (to nearest even) and holds rows 2i, 2i+1 as one uint32 word:
    [ceil(N / 64), K / 2, 64]."""
    _check(precision)
    K, N = w.shape
    w = jnp.pad(w, ((0, 0), (0, _blocks(N) * BLOCK - N)))
    if precision == "fp32":
        return w.reshape(K, _blocks(N), BLOCK).transpose(1, 0, 2)
    return _pairs(w.reshape(K // 2, 2, _blocks(N), BLOCK).transpose(2, 0, 3, 1))


@partial(jax.jit, static_argnames="precision")
def pack_rows(e: Float[Array, "N K"], precision: str = "fp32") -> Shaped[Array, "NB _ 64"]:
    """pack(e.T) without materialising e.T (a tied LM head from the embedding [V, D])."""
    _check(precision)
    N, K = e.shape
    e = jnp.pad(e, ((0, _blocks(N) * BLOCK - N), (0, 0)))
    if precision == "fp32":
        return e.reshape(_blocks(N), BLOCK, K).transpose(0, 2, 1)
    return _pairs(e.reshape(_blocks(N), BLOCK, K // 2, 2).transpose(0, 2, 1, 3))


def precision_of(p: jax.Array) -> str:
    """A packed weight's form: "fp32" or "bf16" (uint32 pairs)."""
    return "bf16" if p.dtype == jnp.uint32 else "fp32"


@partial(jax.jit, static_argnames="n")
def unpack(p: Shaped[Array, "NB _ 64"], n: int | None = None) -> Float[Array, "K N"]:
    """pack's inverse, in fp32 (the bf16 form's weights stay rounded); `n`: the columns
    before padding (None: all)."""
    if precision_of(p) == "bf16":
        NB, K2, _ = p.shape
        w = jax.lax.bitcast_convert_type(p, jnp.bfloat16).astype(jnp.float32)  # [NB, K2, 64, 2]
        return w.transpose(1, 3, 0, 2).reshape(2 * K2, NB * BLOCK)[:, :n]
    NB, K, _ = p.shape
    return p.transpose(1, 0, 2).reshape(K, NB * BLOCK)[:, :n]


def packed_matmul(x: Float[Array, "*R K"], p: Shaped[Array, "NB _ 64"], n: int | None = None
                  ) -> Float[Array, "*R N"]:
    """x @ unpack(p, n) by the kernel (any leading dims). The bf16 form rounds x to bf16 too
    and sums the products in fp32."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = p.shape[0] * BLOCK
    rows, target = x.reshape(-1, K).astype(jnp.float32), TARGET
    if precision_of(p) == "bf16":
        rows, target = _pairs(rows.reshape(-1, K // 2, 2)), TARGET_BF16
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], N), jnp.float32))(rows, p)
    n = N if n is None else n
    return y[:, :n].reshape(*lead, n)
