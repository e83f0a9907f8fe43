"""Pack a model's weights for the CPU kernel (kernels/cpu.py), in place, and back.

Packing replaces each fp32 Linear kernel [K, N] with its [ceil(N/64), K, 64] layout, and gives a tied
LM head a packed copy of the embedding (the lookup keeps the embedding as it is: one more
[V, D] in memory, 0.9 GB for Qwen2.5-1.5B, for a head that costs as much as 1 row at 5 rows).
In place, so the caller's model and the runner's params share one copy of the weights."""
from __future__ import annotations

from flax import nnx

from ssd_jax.kernels import cpu
from ssd_jax.models.transformer import Linear, Transformer


def _linears(model: nnx.Module):
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Linear)]


def _transformers(model: nnx.Module):
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Transformer)]


def packed_precision(model: nnx.Module) -> str | None:
    """"fp32" or "bf16": the packed kernels' form (None: not packed)."""
    for lin in _linears(model):
        if lin.kernel[...].ndim == 3:
            return cpu.precision_of(lin.kernel[...])
    for t in _transformers(model):
        if t.packed_head is not None:
            return cpu.precision_of(t.packed_head[...])
    return None


def is_packed(model: nnx.Module) -> bool:
    return (any(lin.kernel[...].ndim == 3 for lin in _linears(model))
            or any(t.packed_head is not None for t in _transformers(model)))


def pack_model(model: nnx.Module, precision: str = "fp32") -> int:
    """Pack every packable Linear and tied head of `model`; returns how many were packed.
    precision="bf16": the kernel's bf16 form (cpu.pack), a cheaper, different model for a
    draft."""
    n = 0
    for lin in _linears(model):
        w = lin.kernel[...]
        if cpu.packable(w, precision):
            lin.kernel.set_value(cpu.pack(w, precision))
            n += 1
    for t in _transformers(model):
        if t.lm_head is None and t.packed_head is None:
            e = t.embed_tokens.embedding[...]
            if cpu.packable(e, precision, rows=True):  # [V, D]: pack_rows packs its transpose
                t.packed_head = nnx.data(nnx.Param(cpu.pack_rows(e, precision)))
                n += 1
    return n


def unpack_model(model: nnx.Module) -> None:
    """Undo pack_model (a model packed for one device, now to be sharded over several)."""
    for lin in _linears(model):
        if lin.kernel[...].ndim == 3:
            lin.kernel.set_value(cpu.unpack(lin.kernel[...], lin.out_features))
    for t in _transformers(model):
        t.packed_head = nnx.data(None)
