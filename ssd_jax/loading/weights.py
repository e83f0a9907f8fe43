"""Put named weights (Hugging Face naming) into an NNX `Transformer` without a random init."""
from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ssd_jax.config import ModelConfig
from ssd_jax.models.transformer import Transformer

# HF stores Linear weights [out, in]; nnx.Linear keeps its kernel [in, out].
_LINEAR_SUFFIXES = ("_proj.weight", "lm_head.weight")


def abstract_model(config: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStructs in place of arrays: costs no memory and no init time."""
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def _param_for(model: Transformer, hf_name: str) -> tuple[nnx.Param, bool]:
    name = hf_name.removeprefix("model.")
    *path, leaf = name.split(".")
    node = model
    for part in path:
        node = node[int(part)] if part.isdigit() else getattr(node, part)
        if node is None:
            raise KeyError(hf_name)
    if isinstance(node, nnx.Embed):
        return node.embedding, False
    if isinstance(node, nnx.Linear):
        return (node.bias, False) if leaf == "bias" and node.bias is not None else (node.kernel, True)
    return getattr(node, leaf), False


def aligned_empty(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """np.empty on a 64-byte boundary: jax on CPU takes such an array without copying it (an
    unaligned one it copies at ~1 GB/s: 23 of a 1.5B model's 60 s load here)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(nbytes + 64, dtype=np.uint8)
    start = -buf.ctypes.data % 64
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def _to_device(array: np.ndarray, dtype, owned: bool) -> jax.Array:
    """An array onto the default device. `owned`: the loader made it and hands it over, never
    to write to it again, so jax may keep it without a copy (device_put aliases an aligned
    array on CPU; jnp.asarray copies)."""
    if owned and array.dtype == dtype:
        return jax.device_put(array)
    return jnp.asarray(array, dtype=dtype)


def _transposed(array: np.ndarray, rows: int = 256) -> np.ndarray:
    """array.T, contiguous and 64-byte aligned, a band of rows at a time: handing jax a
    transposed view makes it copy element by element (~8x slower; 5 s for Qwen's 150k x 1536
    head here)."""
    if array.ndim != 2:
        return np.ascontiguousarray(array.T)
    out = aligned_empty(array.shape[::-1], array.dtype)
    for i in range(0, array.shape[0], rows):
        out[:, i:i + rows] = array[i:i + rows].T
    return out


def build_model(config: ModelConfig, weights: Iterable[tuple[str, np.ndarray]],
                *, progress=None, owned: bool = False) -> Transformer:
    """Fill an abstract model from (HF name, array) pairs; every parameter must be provided.
    `owned`: the arrays are fresh and handed over (the model may keep them uncopied)."""
    model = abstract_model(config)
    dtype = jnp.dtype(config.dtype)
    for name, array in weights:
        if config.tie_embeddings and name == "lm_head.weight":
            continue  # some exporters save the tied head too; it equals the embedding
        if name.endswith("rotary_emb.inv_freq"):
            continue
        try:
            param, transpose = _param_for(model, name)
        except (KeyError, AttributeError, IndexError):
            raise ValueError(f"checkpoint tensor {name!r} has no place in a {config.arch} model "
                             f"with {config.num_layers} layers: is config.json the right one?")
        array = _transposed(np.asarray(array)) if transpose else np.asarray(array)
        if tuple(array.shape) != tuple(param.get_value().shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {array.shape}, the model "
                             f"expects {tuple(param.get_value().shape)}: config and weights disagree")
        param.set_value(_to_device(array, dtype, owned))
        if progress is not None:
            progress(name)
    missing = [".".join(map(str, path)) for path, leaf in nnx.to_flat_state(nnx.state(model))
               if isinstance(leaf.get_value(), jax.ShapeDtypeStruct)]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}: "
                         "is it complete (all shards present)?")
    return model


def named_weights(model: Transformer):
    """The inverse of build_model: (HF name, numpy array) pairs, for export to HF directories."""
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        parts = [str(p) for p in path]
        kind = parts[-1]
        stem = ".".join(parts[:-1])
        value = np.asarray(leaf.get_value())
        if kind == "embedding":
            yield "model.embed_tokens.weight", value
        elif kind == "kernel":
            yield ("lm_head.weight" if stem == "lm_head" else f"model.{stem}.weight"), value.T
        elif kind == "bias":
            yield f"model.{stem}.bias", value
        else:
            yield f"model.{stem}.weight", value
