"""Shared fixtures: tiny random HF models made offline with transformers, and the SmolLM2 pair.

Shape annotations are contracts here: before anything imports ssd_jax or pallas_kernels,
jaxtyping's import hook wraps every function and dataclass in them with
`jaxtyped(typechecker=beartype)`, so each annotated shape and dtype is checked at every call
(under jit: at trace time, on the tracers). beartype runs with PEP 484's numeric tower (an int
is a valid `float`, as the annotation means); `typing.no_type_check` keeps the hook off the few
user-facing entry points that check their own arguments with errors naming the fix."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

from jaxtyping import install_import_hook

# Once per process: test modules import this file again as `tests.conftest` for its helpers.
if not any(type(f).__module__.startswith("jaxtyping") for f in sys.meta_path):
    if {m.split(".")[0] for m in sys.modules} & {"ssd_jax", "pallas_kernels"}:
        raise RuntimeError("ssd_jax was imported before tests/conftest.py, so the type-check "
                           "hook cannot cover it: import it only in test modules")
    install_import_hook(["ssd_jax", "pallas_kernels"],
                        "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

import os  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _compile_cache() -> None:
    """One XLA compilation cache on disk for the whole run, shared by every process it starts
    (worker processes, notebook kernels inherit the variable): tests build many engines over
    the same models and shapes, and each engine's programs are new functions to jit's
    in-memory cache. 13% off test_ssd + test_smollm2 + test_multiprocess on 2 cores. Fresh
    per run (a temporary directory), so nothing from another version is read. Programs that
    compile in 0.1 s or more are kept, not JAX's default 1 s: the tiny models' programs compile
    in fractions of a second, many times over (test_ssd + test_sd in series: 239-243 s against
    254-277 s with 1 s, back to back)."""
    import atexit
    import shutil
    import tempfile
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="ssd-jax-test-xla-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")


_compile_cache()


def _quick_compiles() -> None:
    """LLVM's optimisation level 0 for the programs the tests compile (this process and the
    worker and server processes it starts inherit XLA_FLAGS; the notebook kernels get this
    flag alone). Much of the suite's time is XLA compiling programs for tiny models that then
    run for milliseconds: one SSD test (test_truncated_vocab_draft_is_lossless) compiled for
    24 s of its 39 at the default level, 15 of 28 at level 0. The matrix products (Eigen's,
    ssd-jax's CPU kernel) are built beforehand and do not change. A level the caller set is
    kept; the product compiles at XLA's default (level 3)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


_quick_compiles()

import pytest  # noqa: E402

TINY_LLAMA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    bos_token_id=1, eos_token_id=2)

TINY_QWEN3 = dict(
    vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2)

# Qwen2: q/k/v biases, GQA (4 query heads over 2 KV heads); tied here, untied in a second fixture.
TINY_QWEN2 = dict(
    vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2)

_HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM", TINY_LLAMA),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", TINY_QWEN2),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", TINY_QWEN3)}


def make_hf_model(path, arch: str, seed: int = 0, **overrides):
    """Save a random tiny HF model (safetensors) to `path`; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_cls, model_cls, base = _HF_CLASSES[arch]
    cfg = getattr(transformers, config_cls)(**{**base, **overrides})
    model = getattr(transformers, model_cls)(cfg)
    # Random init gives near-uniform logits; widen the weights so argmax decisions are crisp
    # and parity at 1e-4 is a meaningful check. Biases (Qwen2's q/k/v) init to zero: give
    # them values too, or a loader that drops them would still pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def with_word_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of a tiny HF model with a tokenizer whose tokens are the words "w<id>" (the
    server needs text; one word per token makes text comparisons token comparisons)."""
    import json
    import shutil
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    shutil.copytree(src, dst)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tok.save(str(dst / "tokenizer.json"))
    return dst


# The 6-token model of the distribution tests: small enough to enumerate every continuation
# (oracles.exact_sequence_probs), sharp enough that drafts are rejected.
VOCAB6 = dict(vocab_size=6, hidden_size=32, intermediate_size=64, num_attention_heads=2,
              num_key_value_heads=1, num_hidden_layers=1, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=0)


def make_vocab6(path, seed: int = 3):
    """A random 6-token Llama saved at `path` (seed 3: the target of every distribution test);
    returns the transformers model."""
    return make_hf_model(path, "llama", seed=seed, **VOCAB6)


def save_noisy_draft(hf_model, path, *, scale: float = 0.02, seed: int = 1):
    """Save `hf_model`'s weights plus Gaussian noise as an HF model at `path`: a draft that
    agrees with the target often but not always (acceptance partial, cache hits and misses)."""
    import torch
    torch.manual_seed(seed)
    draft = type(hf_model)(hf_model.config)
    draft.load_state_dict({k: v + scale * torch.randn_like(v) if v.dim() > 1 else v
                           for k, v in hf_model.state_dict().items()})
    draft.save_pretrained(path, safe_serialization=True)
    return draft


def drive_live(live, requests, slots):
    """A live batch (core/live.py) fed as a server feeds it: (ids, params) requests join free
    slots between rounds until all are done. Returns each request's tokens."""
    pending = collections.deque(enumerate(requests))
    active, out = {}, {}
    while pending or active:
        for slot in live.free_slots():
            if not pending or slot in active:
                continue
            i, (ids, params) = pending.popleft()
            out[i] = [live.join(slot, ids, params, [])[0]]
            active[slot] = i
            if params.max_new_tokens == 1:
                live.leave(slot)
                del active[slot]
        if not active:
            continue
        toks, done, _, _ = live.step()
        for slot, i in list(active.items()):
            want = requests[i][1].max_new_tokens
            out[i] += [int(t) for t in toks[slot] if t >= 0][:want - len(out[i])]
            if len(out[i]) >= want:
                live.leave(slot)
                del active[slot]
    return [out[i] for i in range(len(requests))]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, make_hf_model(path, "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    return path, make_hf_model(path, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    return path, make_hf_model(path, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen2_untied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_untied")
    return path, make_hf_model(path, "qwen2", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default target, loaded once per test session."""
    from ssd_jax import LLM
    return LLM("smollm2")


@pytest.fixture(scope="session", autouse=True)
def _private_autotune_store(tmp_path_factory):
    """Automatic settings read and write a per-user store (~/.cache/ssd_jax/autotune.json);
    tests keep theirs apart, so a test run neither reads a user's measurements nor leaves its
    tiny models' entries behind."""
    path = tmp_path_factory.mktemp("autotune") / "autotune.json"
    mp = pytest.MonkeyPatch()
    # autotune.store_path honours it, here and in subprocesses (the CLI, notebooks, pod jobs).
    mp.setenv("SSD_JAX_TUNE_FILE", str(path))
    yield path
    mp.undo()
