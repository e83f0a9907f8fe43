"""The planner: memory numbers against independent eval_shape sums and closed forms, refusal of
layouts that do not fit, and the 70B + 1B on 4+1 H100 plan of the paper's anchor setup."""
from __future__ import annotations

import json
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

from bench.plan import main as plan_main
from ssd_jax.core.fanout import geometric_probs
from ssd_jax.loading.hf import config_from_hf
from ssd_jax.models.transformer import KVCache, Transformer
from ssd_jax.plan import (HF_CONFIGS, Assumptions, LayoutError, Setup, check_fits,
                          expected_tokens, get_device, predict, resolve)
from ssd_jax.plan import memory
from tests.conftest import TINY_LLAMA, TINY_QWEN3


def _tiny(arch):
    base = TINY_LLAMA if arch == "llama" else TINY_QWEN3
    return config_from_hf({**base, "model_type": arch}, dtype="bfloat16")


def _eval_shape_weight_bytes(config) -> int:
    """Oracle: every parameter of the full model, traced without allocation."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(x.size * x.dtype.itemsize for x in leaves)


def _closed_form_weight_bytes(c, tp: int) -> int:
    """Oracle for TP: split counts written out by hand from the config (2-byte bf16)."""
    div = lambda n: n // tp if n % tp == 0 else n  # noqa: E731
    attn = c.hidden_size * c.head_dim * (2 * div(c.num_heads) + 2 * div(c.num_kv_heads))
    mlp = 3 * c.hidden_size * div(c.intermediate_size)
    norms = 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
    embed = div(c.vocab_size) * c.hidden_size * (1 if c.tie_embeddings else 2)
    return 2 * (c.num_layers * (attn + mlp + norms) + embed + c.hidden_size)


@pytest.fixture(scope="module")
def llama1b():
    return resolve("llama-3.2-1b")[1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_weight_and_kv_bytes_match_eval_shape(arch):
    c = _tiny(arch)
    assert memory.weight_bytes(c, 1).total == _eval_shape_weight_bytes(c)
    for tp in (1, 2, 4):
        assert memory.weight_bytes(c, tp).total == _closed_form_weight_bytes(c, tp)
    cache = jax.eval_shape(lambda: KVCache.zeros(c, 3, 40))
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert memory.kv_cache_bytes(c, 3, 40, 1) == full
    # 2 KV heads split over 2 devices; Qwen tiny's single KV head cannot split: replicated.
    assert memory.kv_cache_bytes(c, 3, 40, 2) == (full // 2 if c.num_kv_heads == 2 else full)


def test_llama_1b_memory_matches_eval_shape(llama1b):
    c = llama1b
    assert memory.weight_bytes(c, 1).total == _eval_shape_weight_bytes(c)
    assert memory.weight_bytes(c, 1).total == 2 * 1_235_814_400  # published parameter count
    assert memory.weight_bytes(c, 4).total == _closed_form_weight_bytes(c, 4)
    cache = jax.eval_shape(lambda: KVCache.zeros(c, 2, 4104))
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert full == 2 * 16 * 2 * 4104 * 8 * 64 * 2
    assert memory.kv_cache_bytes(c, 2, 4104, 1) == full
    assert memory.kv_cache_bytes(c, 2, 4104, 4) == full // 4
    B, M, K, V = 2, 24, 7, c.vocab_size
    assert memory.spec_cache_bytes(B, M, K, V, sampling=False) == 4 * (B * M * (2 + K)
                                                                     + B * (K + 1) * M)
    assert memory.spec_cache_bytes(B, M, K, V, True) - memory.spec_cache_bytes(
        B, M, K, V, False) == B * M * K * V * 4
    assert memory.tree_kv_bytes(c, B, M, K) == 2 * 16 * B * (K + 1 + M * K) * 8 * 64 * 2


@pytest.mark.parametrize("key,total", [("llama-3.1-8b", 16_060_522_496),
                                       ("llama-3.1-70b", 141_107_412_992)])
def test_large_models_match_published_checkpoint_size(key, total):
    """`total_size` of the bf16 safetensors index on the hub (tied/untied heads, 80 layers)."""
    assert memory.weight_bytes(resolve(key)[1], 1).total == total


def test_config_json_path_is_accepted(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["qwen3-0.6b"][2]))
    name, config = resolve(str(tmp_path))
    assert config == resolve("qwen3-0.6b")[1] and name == tmp_path.name
    with pytest.raises(ValueError, match="neither a known model"):
        resolve(str(tmp_path / "missing.json"))


def _setup(target="llama-3.1-70b", draft="llama-3.2-1b", device="h100-80gb", **kw):
    (tn, tc), (dn, dc) = resolve(target), resolve(draft)
    return Setup(target_name=tn, target=tc, draft_name=dn, draft=dc,
                 device=get_device(device), **kw)


def test_refusal_names_the_overflow_and_the_fix():
    with pytest.raises(LayoutError) as e:
        check_fits(_setup(target_devices=1))
    msg = str(e.value)
    # 141.1 GB weights + 1.3 GB KV (80 layers x 2 x 4104 slots x 8 heads x 128 x 2 B) vs 76 GB
    assert "Llama-3.1-70B" in msg and "1xH100-80GB" in msg and "weights 141.1 GB" in msg
    assert "66.5 GB over" in msg and "--target-devices 2 or more" in msg
    with pytest.raises(LayoutError, match=r"Llama-3.1-8B .*\(draft\).*--draft-devices 2 or more"):
        check_fits(_setup(target="qwen3-0.6b", draft="llama-3.1-8b", device="tpu-v5e",
                          target_devices=1))


def test_theorem7_limits():
    assert np.isclose(expected_tokens(0.8, 7), np.sum(geometric_probs(0.8, 7) * np.arange(1, 9)))
    s = _setup(target_devices=4, k=7, sd_k=7)
    all_hit = {p.mode: p for p in predict(s, Assumptions(hit_rate=1.0))[0]}
    all_miss, ph = predict(s, Assumptions(hit_rate=0.0))
    assert ph["tree"] < ph["verify"]  # a 1B tree fits under a 70B verify on its own GPU
    assert math.isclose(all_hit["SSD"].round_s, ph["verify"] + ph["exchange"])
    assert math.isclose(all_miss[2].round_s, ph["verify"] + ph["backup"] + ph["exchange"])
    # AR at batch 1 is bandwidth bound: at least the streamed weight shard over HBM bandwidth.
    w = memory.weight_bytes(s.target, 4)
    assert ph["ar_step"] > (w.total - w.embed_table) / s.device.hbm_bw


def test_paper_layout_fits_and_orders_ar_sd_ssd(capsys):
    rc = plan_main(["--target", "llama-3.1-70b", "--draft", "llama-3.2-1b", "--device",
                    "h100-80gb", "--target-devices", "4", "--draft-devices", "1", "--batch",
                    "1", "--context", "4096", "--k", "7", "--acceptance", "0.8",
                    "--hit-rate", "0.88"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "devices 0-3" in out and "device  4" in out and "kv_heads 8->2" in out
    tok_s = {m: float(re.search(rf"^  {m} .* ([\d.]+) +[\d.]+x$", out, re.M).group(1))
             for m in ("AR", "SD", "SSD")}
    assert tok_s["AR"] < tok_s["SD"] < tok_s["SSD"]
    assert plan_main(["--target", "llama-3.1-70b", "--draft", "llama-3.2-1b"]) == 2
    assert "use --target-devices 2 or more" in capsys.readouterr().err


def test_pod_plan_prints_each_host_and_its_launch_command(capsys):
    """A 70B target over two v5e-8 hosts, the draft on a third: which host holds what (the
    engine's own plan_split) and the same command for every host."""
    rc = plan_main(["--target", "llama-3.1-70b", "--draft", "llama-3.2-1b", "--device",
                    "tpu-v5e", "--target-devices", "16", "--draft-devices", "8",
                    "--devices-per-host", "8", "--coordinator", "t0:8476"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "host 0: target shards 0-7 of TP-16 (lead: requests and results)" in out
    assert "host 1: target shards 8-15 of TP-16" in out
    assert "host 2: draft shards 0-7 of TP-8" in out
    assert "SSD_JAX_COORDINATOR=t0:8476 SSD_JAX_NUM_PROCESSES=3" in out
    assert "--mesh 16,8" in out


def test_pod_plan_refuses_groups_sharing_a_host(capsys):
    # 12 + 4 on two 8-chip hosts: the draft's 4 would be the last 4 chips of host 1
    rc = plan_main(["--target", "llama-3.1-8b", "--draft", "llama-3.2-1b", "--device",
                    "tpu-v5e", "--target-devices", "12", "--draft-devices", "4",
                    "--devices-per-host", "8"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "both the target and the draft" in err and "multiple of 8" in err


def test_packaged_models_plan_by_name():
    """The planner reads a packaged model's shape from its GGUF metadata (SmolLM2 ships with
    the package; the Qwen pair resolves the same way once downloaded)."""
    from ssd_jax.plan import resolve
    name, config = resolve("smollm2")
    assert name == "smollm2"
    assert (config.num_layers, config.hidden_size, config.num_kv_heads) == (30, 576, 3)
    assert config.dtype == "bfloat16"
