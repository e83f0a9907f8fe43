"""Hugging Face model directories: config.json + *.safetensors (single file or sharded index)."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.numpy import load_file

from ssd_jax.config import SUPPORTED_ARCHS, ModelConfig, RopeScaling

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def config_from_hf(cfg: dict, *, dtype: str = "float32") -> ModelConfig:
    """Map an HF config.json (as a dict) onto ModelConfig; unknown model types are refused."""
    model_type = cfg.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported: supported are "
                         f"{', '.join(SUPPORTED_ARCHS)} (HF model_type 'llama', 'qwen2' or "
                         "'qwen3')")
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}: it is not a complete "
                         f"{model_type} config; copy the model's config.json unchanged")
    # Qwen2's q/k/v biases are part of its architecture (its config has no flag for them).
    if cfg.get("mlp_bias") or (cfg.get("attention_bias") and model_type != "qwen2"):
        raise ValueError("attention_bias / mlp_bias checkpoints are not supported: Llama-3.x and "
                         "Qwen3 have no biases (Qwen2's q/k/v biases are); convert a bias-free "
                         "model")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    scaling = None
    if rope and rope.get("rope_type", rope.get("type")) == "llama3":
        scaling = RopeScaling(factor=float(rope["factor"]),
                              low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_position_embeddings=int(
                                  rope["original_max_position_embeddings"]))
    elif rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling type {rope.get('rope_type')!r} is not supported: "
                         "only 'llama3' (and none) are")
    theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return ModelConfig(
        arch=_MODEL_TYPES[model_type], vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
        rope_scaling=scaling, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192), dtype=dtype,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos)


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{directory} has no config.json: point to a Hugging Face model "
                                "directory (config.json + *.safetensors)")
    cfg = json.loads(path.read_text())
    gen = directory / "generation_config.json"
    if gen.exists():  # generation_config's eos list (e.g. Llama-3 instruct's eot) wins
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = eos
    return cfg


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (directory / s).exists()]
        if missing:
            raise FileNotFoundError(f"{directory} lacks shards {missing}: copy every file the "
                                    "index names")
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors: save the model with "
                                "save_pretrained(dir, safe_serialization=True)")
    return files


def iter_hf_weights(directory: Path):
    for f in safetensors_files(directory):
        try:
            tensors = load_file(str(f))
        except Exception as e:  # safetensors raises its own error type for a cut file
            raise ValueError(f"{f} is not a readable safetensors file ({e}): it is probably "
                             "truncated or still downloading; copy it again") from None
        yield from tensors.items()
