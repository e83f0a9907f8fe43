"""Loading: orbax round-trip, conversion CLI, HF sharded index, and the errors users meet."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.convert import main as convert_main
from ssd_jax.loading import load
from ssd_jax.loading.gguf_loader import unpermute_qk
from ssd_jax.models import causal_mask
from ssd_jax.core.runner import ModelRunner


def _logits(model, ids):
    runner = ModelRunner(model)
    T = ids.shape[1]
    out, _ = runner.forward(jnp.asarray(ids), jnp.arange(T)[None], runner.new_cache(1, T),
                            jnp.zeros((1,), jnp.int32), causal_mask(1, T))
    return np.asarray(out)


def test_orbax_roundtrip_gives_identical_logits(tiny_qwen3, tmp_path):
    ids = np.arange(3, 14)[None]
    model, _, _ = load(tiny_qwen3[0])
    assert convert_main([str(tiny_qwen3[0]), str(tmp_path / "ckpt")]) == 0
    restored, _, _ = load(tmp_path / "ckpt")
    assert restored.config == model.config
    np.testing.assert_array_equal(_logits(restored, ids), _logits(model, ids))


def test_convert_never_overwrites_silently(tiny_qwen3, tmp_path, capsys):
    src, dst = str(tiny_qwen3[0]), tmp_path / "ckpt"
    assert convert_main([src, str(dst)]) == 0
    assert convert_main([src, str(dst)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert convert_main([src, str(dst), "--force"]) == 0
    (tmp_path / "file").write_text("keep me")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    assert convert_main([src, str(tmp_path / "file")]) == 2
    assert convert_main([src, str(tmp_path / "other"), "--force"]) == 2
    assert "not an ssd_jax checkpoint" in capsys.readouterr().err
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


def test_sharded_safetensors_index(tiny_llama, tmp_path):
    """A model saved in several shards with an index loads to the same logits."""
    _, hf_model = tiny_llama
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = np.arange(5, 17)[None]
    np.testing.assert_array_equal(_logits(load(tmp_path)[0], ids),
                                  _logits(load(tiny_llama[0])[0], ids))
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    (tmp_path / sorted(set(shard.values()))[0]).unlink()
    with pytest.raises(FileNotFoundError, match="lacks shards"):
        load(tmp_path)


def test_unknown_model_type_names_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="'gpt_neox' is not supported.*llama, qwen2, qwen3"):
        load(tmp_path)


def test_missing_model_path_is_clear():
    with pytest.raises(FileNotFoundError, match="not found: use 'smollm2'"):
        load("/nonexistent/model")
    assert convert_main(["/nonexistent/model", "/tmp/x"]) == 2


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's converter: w.reshape(h, 2, d/h/2, ...).swapaxes(1, 2). Our inverse undoes it."""
    rng = np.random.default_rng(0)
    heads, dim, hidden = 3, 24, 5
    w = rng.normal(size=(dim, hidden))
    permuted = w.reshape(heads, 2, dim // heads // 2, hidden).swapaxes(1, 2).reshape(dim, hidden)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)


def test_shape_mismatch_is_clear(tiny_llama, tmp_path):
    import shutil
    for f in tiny_llama[0].iterdir():
        shutil.copy(f, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config and weights disagree"):
        load(tmp_path)
