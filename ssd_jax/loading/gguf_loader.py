"""GGUF files: metadata -> ModelConfig + tokenizer, tensors dequantised with the `gguf` package."""
from __future__ import annotations

import os
import re
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ssd_jax.config import SUPPORTED_ARCHS, ModelConfig

CONTROL = 3  # llama.cpp's token_type for control tokens such as <|im_start|>
USER_DEFINED = 4  # added tokens that are matched whole but are not special (<tool_call>)
END_OF_TURN = frozenset({"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>",
                         "<|end_of_text|>", "<end_of_turn>"})

_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m or m.group(2) not in _NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama/Qwen2/Qwen3 decoder")
    return f"model.layers.{m.group(1)}.{_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows from HF's rotate-half layout to
    interleaved pairs; without undoing it the model runs but is silently wrong."""
    out_dim = w.shape[0]
    return (w.reshape(num_heads, out_dim // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # GGUF value type -> struct code
_STRING, _ARRAY = 8, 9


def read_header(path: Path, *, stop_at: str | None = None) -> tuple[dict, dict[str, tuple]]:
    """(metadata, {tensor name: (shape, ggml type)}) read straight from a GGUF header.

    The gguf package's reader builds a numpy view per string and takes seconds on Qwen's
    150k-token vocabulary (8 s for the 1.5B here); reading the header here takes a fraction of
    that, so the calling process can learn a model's config and tokenizer without that cost.
    `stop_at` returns as soon as that key has been read (tensors are then not listed)."""
    meta, tensors, _ = _parse_header(path, stop_at)
    return meta, {name: (shape, kind) for name, (shape, kind, _offset) in tensors.items()}


def _parse_header(path: Path, stop_at: str | None = None) -> tuple[dict, dict[str, tuple], int]:
    """(metadata, {name: (shape, ggml type, offset in the data section)}, end of the header)."""
    import struct
    with open(path, "rb") as f:
        def read(code, n=1):
            size = struct.calcsize(code)
            return struct.unpack(f"<{n}{code}", f.read(size * n))

        length = struct.Struct("<Q").unpack

        def strings(count):
            # A vocabulary or merge list (100k-300k strings) in one loop that calls no function
            # of ours: under the tests' type-check hook each call is checked, and a call per
            # string made a SmolLM2 header 1.2 s instead of 0.07.
            return [f.read(length(f.read(8))[0]).decode("utf-8", "replace")
                    for _ in range(count)]

        def string():
            return strings(1)[0]

        def value(kind):
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                inner, count = read("I")[0], read("Q")[0]
                if inner in _SCALARS:
                    return list(read(_SCALARS[inner], count))
                if inner == _STRING:
                    return strings(count)
                return [value(inner) for _ in range(count)]
            return read(_SCALARS[kind])[0]

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic): is the download complete?")
        read("I")  # version
        n_tensors, n_kv = read("Q")[0], read("Q")[0]
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(read("I")[0])
            if key == stop_at:
                return meta, {}, f.tell()
        tensors = {}
        for _ in range(n_tensors):
            name, n_dims = string(), read("I")[0]
            dims = read("Q", n_dims)
            kind, offset = read("I")[0], read("Q")[0]
            tensors[name] = (tuple(reversed(dims)), kind, offset)  # GGUF lists the fastest dim first
        return meta, tensors, f.tell()


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its raw blocks as a read-only view of the memory-mapped file
    ([..., bytes per row] uint8 for quantised types; the plain dtype for F32/F16)."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray


_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def open_gguf(path: Path) -> list[GGUFTensor]:
    """The file's tensors, memory-mapped, from our own header reader (drop the list after
    loading, or the pages it touched stay resident)."""
    import gguf
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    meta, infos, end = _parse_header(path)
    align = int(meta.get("general.alignment", 32))
    start = -(-end // align) * align
    # A plain ndarray view: slices of an np.memmap run a Python hook each (2M in a 1.5B load).
    file = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    out = []
    for name, (shape, kind, offset) in infos.items():
        qtype = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(shape))
        raw = file[start + offset: start + offset + count // block * size]
        if raw.size != count // block * size:
            raise ValueError(f"{path} ends inside tensor {name!r}: is the download complete?")
        if qtype.name in _PLAIN:
            data = raw.view(_PLAIN[qtype.name]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block * size)
        out.append(GGUFTensor(name, qtype, data))
    return out


def stop_token_ids(meta: dict) -> tuple[int, ...]:
    """Every token that ends a turn: the file's eos/eot/eom ids plus the control tokens spelled
    as an end of turn or text (Qwen's chat template ends turns with <|im_end|>, while the
    model may also emit <|endoftext|>, the file's padding and bos token)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    ids = {int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if meta.get(k) is not None}
    ids |= {i for i, (t, kind) in enumerate(zip(tokens, types))
            if kind == CONTROL and t in END_OF_TURN}
    return tuple(sorted(ids))


def config_from_gguf(meta: dict, tensor_names: set[str], *, dtype: str = "float32",
                     embed_rows: int | None = None) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported: supported are "
                         f"{', '.join(SUPPORTED_ARCHS)}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF stores Llama-3.1 rope frequency factors (rope_freqs), which "
                         "are not supported yet: load the HF safetensors directory instead")
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    # The embedding's rows are the vocabulary the model computes over (Qwen pads its tokenizer's
    # 151,665 tokens to 151,936 rows); the metadata's count is only a fallback.
    vocab = embed_rows or g("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        arch=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(g("context_length", 8192)), dtype=dtype,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=stop_token_ids(meta))


# Elements dequantised per call: gguf's numpy dequantisers build several temporaries the size
# of their input, so a whole 150k x 1536 embedding runs out of cache (~40 M elements/s here);
# slices of ~1M elements run 3-4x faster (a 1.5B model loads in ~20 s instead of ~60 s).
DEQUANT_CHUNK = 1 << 20


def dequantize(data: np.ndarray, tensor_type, pool: Executor | None = None) -> np.ndarray:
    """A GGUF tensor's raw blocks -> a fresh, 64-byte-aligned float32 array, a slice of rows at
    a time (over `pool`'s threads when given: numpy's arithmetic releases the GIL, and the
    1.5B Qwen target's tensors dequantised 2.3x faster on two threads than on one here).

    A copy, always: an F32 tensor comes back as a view of the memory-mapped file, and JAX on
    CPU may alias it, which would keep the whole file mapped (and resident) for good."""
    import gguf
    from ssd_jax.loading.weights import aligned_empty
    if data.ndim != 2 or data.shape[0] <= 1:
        return np.array(gguf.quants.dequantize(data, tensor_type), dtype=np.float32, copy=True)
    cols = gguf.quants.dequantize(data[:1], tensor_type).shape[1]
    out = aligned_empty((data.shape[0], cols))
    rows = max(1, DEQUANT_CHUNK // cols)

    def fill(i: int) -> None:
        out[i:i + rows] = gguf.quants.dequantize(data[i:i + rows], tensor_type)

    starts = range(0, data.shape[0], rows)
    if pool is None or len(starts) == 1:
        for i in starts:
            fill(i)
    else:
        for _ in pool.map(fill, starts):  # re-raises a slice's error here
            pass
    return out


def iter_gguf_weights(tensors: list[GGUFTensor], config: ModelConfig):
    """(HF name, float32 array) pairs, dequantised (on as many threads as this process has
    cores: one in a pinned worker), with llama's q/k permutation undone."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    pool = ThreadPoolExecutor(cores) if (cores or 1) > 1 else None
    try:
        yield from _weights(tensors, config, pool)
    finally:
        if pool is not None:
            pool.shutdown()


def _weights(tensors: list[GGUFTensor], config: ModelConfig, pool: Executor | None):
    for t in tensors:
        w = dequantize(t.data, t.tensor_type, pool)
        name = hf_name(t.name)
        if config.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            w = unpermute_qk(w, heads)
        yield name, w
