"""Published Hugging Face `config.json` files of the models we plan for, verbatim (JSON -> Python
literals). No weights are needed to plan: shapes come from these through `config_from_hf`.

Sources are the `config.json` of each repository on the Hugging Face hub. Llama entries are the
Instruct repositories (the SSD paper's models); the base repositories differ only in
`eos_token_id`, which does not change any shape.
"""
from __future__ import annotations

_LLAMA3_COMMON = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
_LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 40960, "model_type": "qwen3",
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

# key -> (display name, HF repository, config.json)
HF_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "llama-3.1-8b": ("Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct", {
        **_LLAMA3_COMMON, "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rope_scaling": _LLAMA31_ROPE, "tie_word_embeddings": False,
        "transformers_version": "4.42.3"}),
    "llama-3.1-70b": ("Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", {
        **_LLAMA3_COMMON, "hidden_size": 8192, "intermediate_size": 28672,
        "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
        "rope_scaling": _LLAMA31_ROPE, "tie_word_embeddings": False,
        "transformers_version": "4.42.3"}),
    "llama-3.2-1b": ("Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct", {
        **_LLAMA3_COMMON, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0}, "tie_word_embeddings": True,
        "transformers_version": "4.45.0.dev0"}),
    "qwen3-32b": ("Qwen3-32B", "Qwen/Qwen3-32B", {
        **_QWEN3_COMMON, "hidden_size": 5120, "intermediate_size": 25600,
        "max_window_layers": 64, "num_attention_heads": 64, "num_hidden_layers": 64,
        "tie_word_embeddings": False}),
    "qwen3-0.6b": ("Qwen3-0.6B", "Qwen/Qwen3-0.6B", {
        **_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072,
        "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28,
        "tie_word_embeddings": True}),
}


def resolve(spec: str, *, dtype: str = "bfloat16"):
    """(display name, ModelConfig) for a catalogue key or a path to a config.json / HF directory."""
    import json
    from pathlib import Path

    from ssd_jax.loading.hf import config_from_hf

    key = spec.lower()
    if key in HF_CONFIGS:
        name, _, cfg = HF_CONFIGS[key]
        return name, config_from_hf(cfg, dtype=dtype)
    from ssd_jax.loading import packaged
    if packaged.find(spec) is not None:  # a model shipped as PyPI data: its GGUF's metadata
        from ssd_jax.loading import describe
        return spec, describe(spec, dtype=dtype)[0]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {spec!r} is neither a known model ({', '.join(HF_CONFIGS)}) nor "
                         "a config.json / Hugging Face directory: pass one of those")
    name = path.parent.name if path.name == "config.json" else path.stem
    return name or spec, config_from_hf(json.loads(path.read_text()), dtype=dtype)
