"""orbax checkpoints of our models: params (orbax) + ModelConfig (JSON) + tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from ssd_jax.config import ModelConfig
from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.loading.weights import abstract_model
from ssd_jax.models.transformer import Transformer

CONFIG_FILE = "ssd_jax_config.json"


def _checkpointer() -> ocp.StandardCheckpointer:
    if jax.process_count() == 1:
        return ocp.StandardCheckpointer()
    me = jax.process_index()
    return ocp.StandardCheckpointer(multiprocessing_options=ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"ssd_jax_{me}"))


def is_orbax_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).exists()


def save(model: Transformer, tokenizer: Tokenizer | None, directory: str | Path,
         *, extra: dict | None = None) -> Path:
    """Write params to DIR/params with orbax, the config to DIR/ssd_jax_config.json.
    `extra` (e.g. a draft's vocabulary map) is saved as JSON beside them."""
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model, nnx.Param).to_pure_dict()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "params", state, force=True)
    marker = directory / "params" / "commit_success.txt"
    if marker.exists():  # orbax writes this machine's absolute folder into it
        marker.write_text("Checkpoint commit was successful\n")
    (directory / CONFIG_FILE).write_text(json.dumps(
        {"model": model.config.to_dict(), "extra": extra or {}}, indent=1))
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory


def describe(directory: str | Path, *, dtype: str | None = None
             ) -> tuple[ModelConfig, Tokenizer | None, dict]:
    """Config, tokenizer and extra of a checkpoint, without restoring its params."""
    directory = Path(directory).absolute()
    meta = json.loads((directory / CONFIG_FILE).read_text())
    config = ModelConfig.from_dict(meta["model"])
    if dtype is not None:
        config = config.replace(dtype=dtype)
    tokenizer = Tokenizer.load(directory) if (directory / "tokenizer.json").exists() else None
    return config, tokenizer, meta.get("extra", {})


def load(directory: str | Path, *, dtype: str | None = None) -> tuple[Transformer, Tokenizer | None, dict]:
    directory = Path(directory).absolute()
    if not is_orbax_dir(directory):
        raise FileNotFoundError(f"{directory} is not an ssd_jax orbax checkpoint (no {CONFIG_FILE}):"
                                " create one with `python -m ssd_jax.convert SRC DST`")
    meta = json.loads((directory / CONFIG_FILE).read_text())
    config = ModelConfig.from_dict(meta["model"])
    saved_dtype = config.dtype
    model = abstract_model(config)
    abstract = nnx.state(model, nnx.Param)
    # Restore onto this process's own device, and (under jax.distributed, e.g. in an SSD worker
    # process) without global barriers: each process reads the checkpoint for itself.
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=local),
                          abstract.to_pure_dict())
    with _checkpointer() as ckpt:
        restored = ckpt.restore(directory / "params", target)
    abstract.replace_by_pure_dict(restored)
    nnx.update(model, abstract)
    if dtype is not None and dtype != saved_dtype:
        from ssd_jax.loading.weights import build_model, named_weights
        model = build_model(config.replace(dtype=dtype), named_weights(model))
    tokenizer = Tokenizer.load(directory) if (directory / "tokenizer.json").exists() else None
    return model, tokenizer, meta.get("extra", {})
