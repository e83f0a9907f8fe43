"""GGUF round trips of a tiny random Qwen2 with every tensor type the packaged Qwen2.5-Coder files
use: F32 norms and q/k/v biases, Q8_0, Q5_0, Q4_K and Q6_K weights.

Why not only transformers as the oracle: for qwen2, transformers' GGUF loader dequantises with
gguf-py, the very code ssd_jax calls, so a wrong block decoder would fool both. Here the K-quant
blocks are packed from chosen fields (scales, mins, quants) whose float values are known by
construction, and the Q8_0/Q5_0 blocks (quantised by gguf-py) are read back by the numpy decoder
of tests/oracles.py, written from ggml's block layouts. Logits are then compared to a
transformers Qwen2 built from those independent weights, and to transformers loading the same
file (its config, tensor naming and tokenizer readers are its own).
"""
import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ssd_jax.loading import gguf_loader, load
from ssd_jax.loading.weights import named_weights
from ssd_jax.models import causal_mask
from ssd_jax.core.runner import ModelRunner
from tests.oracles import BLOCKS, QK_K, Q, dequantize, f16


# Tiny shapes as in conftest's TINY_QWEN2, widened so every row is a whole K-quant super-block.
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
EPS, THETA = 1e-6, 1_000_000.0

# Every quantised type on several tensor shapes, including the [out, 512] ffn_down rows.
TYPES = {
    "token_embd": Q.Q4_K, "output": Q.Q6_K,
    "blk.0.attn_q": Q.Q8_0, "blk.0.attn_k": Q.Q5_0, "blk.0.attn_v": Q.Q4_K,
    "blk.0.attn_output": Q.Q6_K, "blk.0.ffn_gate": Q.Q4_K, "blk.0.ffn_up": Q.Q6_K,
    "blk.0.ffn_down": Q.Q5_0,
    "blk.1.attn_q": Q.Q4_K, "blk.1.attn_k": Q.Q6_K, "blk.1.attn_v": Q.Q8_0,
    "blk.1.attn_output": Q.Q5_0, "blk.1.ffn_gate": Q.Q8_0, "blk.1.ffn_up": Q.Q5_0,
    "blk.1.ffn_down": Q.Q6_K,
}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                 "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")


# --- K-quant blocks packed from chosen fields --------------------------------------------------

def _pack_q4_k(rng, rows: int, cols: int):
    """Random Q4_K blocks and their values, d*scale*q - dmin*min, computed from the fields."""
    n = rows * cols // QK_K
    d = rng.uniform(1e-4, 3e-4, n).astype(np.float16)
    dmin = rng.uniform(0.5e-3, 2e-3, n).astype(np.float16)
    sc, mn = rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8))  # 6-bit, high bits used
    q = rng.integers(0, 16, (n, QK_K))
    scales = np.zeros((n, 12), np.int64)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    qs = np.concatenate([q[:, 64 * c:64 * c + 32] | (q[:, 64 * c + 32:64 * c + 64] << 4)
                         for c in range(4)], axis=1)
    raw = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                          scales.astype(np.uint8), qs.astype(np.uint8)], axis=1)
    sub = np.arange(QK_K) // 32
    values = (d.astype(np.float32)[:, None] * sc[:, sub] * q
              - dmin.astype(np.float32)[:, None] * mn[:, sub])
    return raw.reshape(rows, -1), values.astype(np.float32).reshape(rows, cols)


def _pack_q6_k(rng, rows: int, cols: int):
    """Random Q6_K blocks and their values, d*scale*(q-32), computed from the fields."""
    n = rows * cols // QK_K
    d = rng.uniform(4e-5, 1e-4, n).astype(np.float16)
    sc = rng.integers(-128, 128, (n, 16))  # int8, negative scales included
    q = rng.integers(0, 64, (n, QK_K))
    ql = np.zeros((n, 128), np.int64)
    qh = np.zeros((n, 64), np.int64)
    for h in range(2):
        q1, q2, q3, q4 = (q[:, 128 * h + 32 * k:128 * h + 32 * k + 32] for k in range(4))
        ql[:, 64 * h:64 * h + 32] = (q1 & 0xF) | ((q3 & 0xF) << 4)
        ql[:, 64 * h + 32:64 * h + 64] = (q2 & 0xF) | ((q4 & 0xF) << 4)
        qh[:, 32 * h:32 * h + 32] = ((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4)
                                     | ((q4 >> 4) << 6))
    raw = np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8),
                          sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(n, 2)],
                         axis=1)
    values = d.astype(np.float32)[:, None] * sc[:, np.arange(QK_K) // 16] * (q - 32)
    return raw.reshape(rows, -1), values.astype(np.float32).reshape(rows, cols)


def _quantised(rng, qtype, rows: int, cols: int):
    """(raw blocks, independently known float values) for one [rows, cols] weight."""
    if qtype == Q.Q4_K:
        return _pack_q4_k(rng, rows, cols)
    if qtype == Q.Q6_K:
        return _pack_q6_k(rng, rows, cols)
    w = rng.normal(0, 0.08, (rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    values = dequantize(raw, qtype)
    # The decoder is the oracle here: it must give back the floats gguf-py was asked to
    # quantise, to within one quantisation step d (Q5_0 clips a block's extreme to 15*d, one
    # step off, and d is rounded to fp16: hence 1.01); a misread layout is off by ~the weights.
    step = np.abs(f16(raw.reshape(-1, BLOCKS[qtype][1])[:, :2]))
    err = np.abs(values - w).reshape(-1, 32).max(axis=1)
    assert (err <= 1.01 * step).all(), f"{qtype.name} decoder disagrees with its source floats"
    return raw, values


# --- the tiny file ---------------------------------------------------------------------------

def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable-character table (byte-level BPE's base alphabet)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ Ġ", "d e", "de f", "Ġ i", "Ġi n", "o r", "Ġ f", "Ġf or",
          "r e", "Ġ re", "Ġre t", "u r", "Ġret ur", "Ġretur n", "ĉ ĉ", "Ċ Ċ"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _vocab() -> tuple[list[str], list[int]]:
    tokens = _byte_chars() + [m.replace(" ", "") for m in MERGES] + SPECIALS + ["[PAD0]", "[PAD1]"]
    types = [1] * (len(tokens) - len(SPECIALS) - 2) + [3] * len(SPECIALS) + [5, 5]
    return tokens, types


def write_tiny_qwen2(path, *, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Write the tiny mixed-type Qwen2 GGUF; returns its float weights under HF names."""
    rng = np.random.default_rng(seed)
    tokens, types = _vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2 mixed quants")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    expected = {}
    shapes = {"token_embd": (vocab, HIDDEN), "output": (vocab, HIDDEN),
              "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}

    def add_quantised(gguf_name, hf_name):
        qtype = TYPES[gguf_name]
        raw, values = _quantised(rng, qtype, *shapes[gguf_name.split(".")[-1]])
        w.add_tensor(f"{gguf_name}.weight", raw, raw_dtype=qtype)
        expected[hf_name] = values

    def add_f32(gguf_name, hf_name, values):
        w.add_tensor(gguf_name, values.astype(np.float32))
        expected[hf_name] = values.astype(np.float32)

    add_quantised("token_embd", "model.embed_tokens.weight")
    if not tied:
        add_quantised("output", "lm_head.weight")
    add_f32("output_norm.weight", "model.norm.weight", rng.uniform(0.5, 1.5, HIDDEN))
    for i in range(LAYERS):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                     "ffn_down"):
            add_quantised(f"blk.{i}.{part}", f"model.layers.{i}.{HF_NAMES[part]}.weight")
        for part, size in (("attn_q", HIDDEN), ("attn_k", KV_HEADS * HEAD_DIM),
                           ("attn_v", KV_HEADS * HEAD_DIM)):
            add_f32(f"blk.{i}.{part}.bias", f"model.layers.{i}.{HF_NAMES[part]}.bias",
                    rng.normal(0, 0.5, size))
        for part in ("attn_norm", "ffn_norm"):
            add_f32(f"blk.{i}.{part}.weight", f"model.layers.{i}.{HF_NAMES[part]}.weight",
                    rng.uniform(0.5, 1.5, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _reference_model(expected: dict, *, tied: bool):
    """transformers' Qwen2 holding the independently known weights."""
    import transformers
    cfg = transformers.Qwen2Config(
        vocab_size=expected["model.embed_tokens.weight"].shape[0], hidden_size=HIDDEN,
        intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=512, rms_norm_eps=EPS,
        rope_theta=THETA, tie_word_embeddings=tied)
    model = transformers.Qwen2ForCausalLM(cfg)
    state = {k: torch.from_numpy(v) for k, v in expected.items()}
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module", params=["untied", "tied"])
def tiny(request, tmp_path_factory):
    tied = request.param == "tied"
    path = tmp_path_factory.mktemp(f"tiny_qwen2_gguf_{request.param}") / "tiny-qwen2.gguf"
    expected = write_tiny_qwen2(path, tied=tied)
    model, tok, _ = load(path)
    return path, expected, model, tok, tied


def _our_logits(model, ids: np.ndarray) -> np.ndarray:
    runner = ModelRunner(model)
    B, T = ids.shape
    logits, _ = runner.forward(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(T), (B, T)),
                               runner.new_cache(B, 32), jnp.zeros((B,), jnp.int32),
                               causal_mask(B, T))
    return np.asarray(logits)


def _ids(vocab: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, vocab, size=(3, 23))


def test_packed_k_quant_blocks_decode_to_their_fields():
    """The test's own decoder reads the packed K-quant blocks back to the chosen values (so
    packer and decoder follow one layout), for a few super-blocks of each type."""
    rng = np.random.default_rng(3)
    for qtype, pack in ((Q.Q4_K, _pack_q4_k), (Q.Q6_K, _pack_q6_k)):
        raw, values = pack(rng, 3, 512)
        assert raw.shape == (3, 2 * BLOCKS[qtype][1])
        np.testing.assert_allclose(dequantize(raw, qtype), values, rtol=1e-6, atol=1e-8)


def test_file_has_every_tensor_type(tiny):
    path, *_ = tiny
    kinds = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds == {Q.F32, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K}


def test_weights_equal_independent_dequantisation(tiny):
    """Every parameter ssd_jax built from the file equals the independently known floats."""
    _, expected, model, _, tied = tiny
    ours = dict(named_weights(model))
    assert set(ours) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(ours[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
    assert model.config.tie_embeddings == tied


def test_slices_of_a_few_rows_load_the_same_floats(tiny, monkeypatch):
    """The loader dequantises a slice of rows at a time, on a thread per core: with slices of
    2-3 rows, a ragged last slice and three threads, still the known floats."""
    path, expected, *_ = tiny
    monkeypatch.setattr(gguf_loader, "DEQUANT_CHUNK", 600)
    monkeypatch.setattr(gguf_loader.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    ours = dict(named_weights(load(path)[0]))
    for name, want in expected.items():
        np.testing.assert_allclose(ours[name], want, rtol=1e-6, atol=1e-7, err_msg=name)


def test_tensor_views_equal_the_gguf_packages(tiny):
    """Our memory-mapped tensor views (from our own header reader): the gguf package's reader
    sees the same names, types and bytes."""
    path, *_ = tiny
    theirs = gguf.GGUFReader(str(path)).tensors
    ours = gguf_loader.open_gguf(path)
    assert [(t.name, t.tensor_type) for t in ours] == [(t.name, t.tensor_type) for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)


def test_a_truncated_file_is_one_clear_error(tiny, tmp_path):
    path, *_ = tiny
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="ends inside tensor .*download complete"):
        gguf_loader.open_gguf(cut)


def test_qkv_biases_present_and_nonzero(tiny):
    _, expected, model, _, _ = tiny
    for i, layer in enumerate(model.layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            bias = np.asarray(getattr(layer.self_attn, proj).bias[...])
            assert np.abs(bias).min() > 0 and np.abs(bias).max() > 0.1
            np.testing.assert_array_equal(bias, expected[f"model.layers.{i}.self_attn.{proj}.bias"])
        assert layer.self_attn.o_proj.bias is None and layer.mlp.up_proj.bias is None


def test_logits_match_transformers_on_independent_weights(tiny):
    _, expected, model, _, tied = tiny
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        ref = _reference_model(expected, tied=tied)(torch.tensor(ids)).logits.numpy()
    assert np.abs(ref).max() > 1.0  # not a degenerate near-zero model
    np.testing.assert_allclose(_our_logits(model, ids), ref, atol=1e-4, rtol=0)


def test_logits_match_transformers_loading_the_same_gguf(tiny):
    import transformers
    path, _, model, _, _ = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(_our_logits(model, ids), ref, atol=1e-4, rtol=0)


def test_tokenizer_and_template_match_transformers(tiny):
    import transformers
    path, _, _, tok, _ = tiny
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["the def in for return", "  the\t\tthe\n\nreturn 123 café",
                 "<|im_start|>user\nthe<|im_end|>\n", "don't 日本 🙂"]:
        assert tok.encode(text) == hf_tok.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    msgs = [{"role": "user", "content": "def f(): return 1"}]
    assert tok.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_im_end_and_endoftext_are_both_stop_tokens(tiny):
    _, _, model, tok, _ = tiny
    tokens, _ = _vocab()
    want = {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}
    assert set(model.config.eos_token_ids) == want
    assert set(tok.eos_token_ids) == want


def test_unsupported_architecture_is_one_line_error(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as err:
        load(path)
    message = str(err.value)
    assert "\n" not in message and "'phi3'" in message
    assert all(arch in message for arch in ("llama", "qwen2", "qwen3"))
