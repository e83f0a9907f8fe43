"""Frozen, keyword-only configuration dataclasses.

They are hashable, so they can be `static_argnames` of `jax.jit`; every one validates itself in
`__post_init__` so a bad value fails where it is written, with the fix in the message.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import no_type_check

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16")
# Attention implementations (ssd_jax.models.attention.select_attention): "auto" = the Pallas
# kernel on GPU/TPU and jnp elsewhere; "pallas-interpret" runs the kernel interpreted anywhere.
ATTENTION_BACKENDS = ("auto", "jnp", "pallas", "pallas-interpret")


def _require_ints(obj, *names: str) -> None:
    """A float K or token count would fail deep inside jit with a shape error: catch it here."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name}={value!r} is invalid: it must be an integer")


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias as sorted (id, value) pairs, or a ValueError naming the fix."""
    pairs = bias.items() if isinstance(bias, dict) else bias
    try:
        out = {}
        for t, v in pairs:
            if (isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0
                    or isinstance(v, bool) or not isinstance(v, numbers.Real)
                    or not math.isfinite(v)):
                raise TypeError
            out[int(t)] = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias={bias!r} is invalid: give {{token id: value}} with "
                         "non-negative integer ids and finite values, e.g. {50256: -100}"
                         ) from None
    return tuple(sorted(out.items()))


def _check_seed(seed: int | None) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= seed < 2**32):
        raise ValueError(f"seed={seed!r} is invalid: use an integer in [0, 2**32) or None")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 `rope_scaling` (rope_type="llama3"): long wavelengths are slowed by `factor`,
    short ones kept, and the band in between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder-only Llama-3.x / Qwen2 / Qwen3 model."""

    arch: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"unknown model arch {self.arch!r}: supported are {', '.join(SUPPORTED_ARCHS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported: use one of {DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}: grouped-query attention needs whole groups")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: use one of "
                             f"{ATTENTION_BACKENDS}")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head's q and k (RMSNorm over head_dim) before RoPE."""
        return self.arch == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 (and Qwen2.5) add a bias to the q, k and v projections; nothing else has one."""
        return self.arch == "qwen2"

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)


MAX_LOGPROBS = 20  # top alternatives per token, at most (as vLLM's and OpenAI's default cap)


# User-facing settings that validate (and normalise) their own fields with errors naming the fix:
# the test run's type-check hook (tests/conftest.py) is kept off them, since it would pre-empt
# those errors (e.g. stop_token_ids=[2] is accepted and stored as a tuple).
@no_type_check
@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings (the vLLM-style surface users know).

    temperature=0 is greedy. top_k=0, top_p=1 and min_p=0 disable those filters (min_p, vLLM's
    and llama.cpp's: a token is kept when its probability is at least min_p times the most
    likely token's, after temperature). `seed` makes a request's
    sampled tokens reproducible regardless of which other requests share its batch; without one,
    the engine draws a fresh seed per request (from EngineConfig.seed), so two unseeded requests
    in a batch sample independently.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings (a string, or several; stored as a tuple): the answer ends at the first
    # one its text holds, found in the decoded text after each chunk (ssd_jax/stop_strings.py).
    # The text ends right before it (with it when include_stop_str_in_output), and token_ids
    # end with the token that completed it, as vLLM's. Needs a tokenizer.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # The target's log-probability of each generated token and its `logprobs` most likely
    # alternatives (RequestOutput.logprobs); None: not computed.
    logprobs: int | None = None
    # The same for each prompt token after the first (RequestOutput.prompt_logprobs), as
    # vLLM's: what scoring a text (log-likelihood evaluation) needs.
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: {token id: value added to the target's logit} (a dict, or pairs;
    # stored as sorted (id, value) pairs). -100 bans a token in practice, +100 forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: the first min_tokens tokens of the answer are never a stop token
    # (EOS or stop_token_ids); 0: off.
    min_tokens: int = 0
    # Penalties on the target's logits, as OpenAI and vLLM define them (0, 0 and 1: off).
    # presence / frequency: subtract the value once / once per occurrence from the logit of
    # each token the answer already holds, in [-2, 2]. repetition (vLLM's, after the CTRL
    # paper): the logit of each token in the prompt or the answer is divided by it when
    # positive and multiplied by it when negative, > 0.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Answers per prompt (vLLM's and OpenAI's n): generate returns n outputs for the prompt,
    # consecutive; answer i samples with `choice_seed(seed, i)` (answer 0 keeps the seed, so
    # n=1 and the first of n=2 are the same text). Greedy answers are equal, as vLLM's.
    n: int = 1

    def __post_init__(self):
        _require_ints(self, "top_k", "max_new_tokens", "min_tokens", "n")
        if self.n < 1:
            raise ValueError(f"n={self.n} is invalid: ask for 1 or more answers per prompt")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is invalid: it must lie in [0, "
                             f"max_new_tokens={self.max_new_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)
                                  or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name}={v!r} is invalid: give None (off) or the number of "
                                 f"top alternatives per token, 0..{MAX_LOGPROBS}")
        _check_seed(self.seed)
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature={self.temperature} is invalid: use 0 for greedy or a finite "
                "value > 0")
        if isinstance(self.stop_token_ids, numbers.Integral) or not all(
                isinstance(t, numbers.Integral) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} is invalid: give a tuple of "
                             "token ids, e.g. stop_token_ids=(2,)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop={self.stop!r} is invalid: give a non-empty string or a "
                             "list of them, e.g. stop=['\\n\\n']")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output={self.include_stop_str_in_output!r} "
                             "is invalid: pass True or False")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not 0 <= self.top_k < 2**31:  # an int32 inside the programs
            raise ValueError(f"top_k={self.top_k} is invalid: use 0 (off) or a positive count "
                             "below 2**31 (a count past the vocabulary keeps every token)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} is invalid: it must lie in (0, 1]; 1 turns it off")
        v = self.min_p
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v <= 1.0:
            raise ValueError(f"min_p={v!r} is invalid: it must lie in [0, 1]; 0 turns it off")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} is invalid: ask for at least 1 token")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name}={v!r} is invalid: it must lie in [-2, 2]; 0 turns "
                                 "it off")
        v = self.repetition_penalty
        if (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
                or v <= 0):
            raise ValueError(f"repetition_penalty={v!r} is invalid: give a finite value > 0 "
                             "(1 turns it off; > 1 discourages repeats)")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the programs then carry per-row token counts)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def choice_seed(seed: int, i: int) -> int:
    """The seed of answer i of a request seeded `seed` that asks for several (n): answer 0
    keeps it; the others step by the golden ratio's 32-bit constant, far apart."""
    return (seed + i * 0x9E3779B9) % 2**32


@no_type_check  # validates itself, as SamplingParams
@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """Speculation settings shared by SD and SSD (SSD-only fields are ignored by SD).

    k=None (the default) lets the engine choose K, the branch budget and the backup from step
    costs it measures once per machine and pair (`ssd_jax.autotune`), and for a sampled SSD run
    Saguaro's C from the pair's distributions (`ssd_jax.saguaro_curve`); explicit values win.

    ar_fallback=True: a run whose settings (the best ones with k=None, else those given) the
    speed model predicts slower than plain AR steps (acceptance too low for speculation to pay
    on this machine) decodes with AR instead, on the devices the asked mode's target uses.
    Each run decides afresh, with what runs have taught the model so far. After
    engine.PROBE_TOKENS tokens so decoded (and at least PROBE_RATIO times the mode's last
    speculative run), one run speculates anyway, so that the pair's acceptance keeps being
    learnt and speculation resumes when the workload turns. Given settings are held to the
    model only with the geometric fan-out and a neural or fast backup (the model's); others
    never fall back. Off by default: a call runs the mode it asks for (a benchmark cell, a
    comparison of modes) and only warns.
    """

    k: int | None = None  # lookahead: draft tokens per round (None: chosen automatically)
    fanout: str = "geometric"  # SSD: "uniform" | "geometric" | "empirical"
    budget: int = 0  # SSD: branches per row M (0 = 2 * (K + 1), or chosen with K)
    c: float | None = None  # SSD Saguaro constant in (0, 1] (None: chosen with K at T > 0, else 1)
    backup: str | None = None  # SSD: "neural" | "fast" | "auto" (None: chosen with K, or neural)
    ar_fallback: bool = False  # decode with AR when the model predicts it faster

    def __post_init__(self):
        _require_ints(self, "budget")
        if not isinstance(self.ar_fallback, bool):
            raise ValueError(f"ar_fallback={self.ar_fallback!r} is invalid: pass True or False")
        if self.k is not None:
            _require_ints(self, "k")
            if self.k < 1:
                raise ValueError(f"K={self.k} is invalid: lookahead must be >= 1")
            if self.budget and self.budget < self.k + 1:
                raise ValueError(f"budget={self.budget} is smaller than K+1={self.k + 1}: every "
                                 "accept length needs at least one branch; raise the budget or "
                                 "lower K")
        if self.budget < 0:
            raise ValueError(f"budget={self.budget} is invalid: use 0 (default) or a count")
        if self.fanout not in ("uniform", "geometric", "empirical"):
            raise ValueError(f"fanout={self.fanout!r}: use 'uniform', 'geometric' or 'empirical'")
        if self.c is not None and not 0.0 < self.c <= 1.0:
            raise ValueError(f"c={self.c} is invalid: Saguaro's C must lie in (0, 1]")
        if self.backup not in (None, "neural", "fast", "auto"):
            raise ValueError(f"backup={self.backup!r}: use 'neural', 'fast' or 'auto'")

    @property
    def auto(self) -> bool:
        return self.k is None

    @property
    def branches(self) -> int:
        if self.k is None:
            raise ValueError("SpecConfig(k=None) has no branch count until the engine resolves "
                             "it: pass k=... or let LLM choose")
        return self.budget or 2 * (self.k + 1)

    @property
    def backup_or_default(self) -> str:
        return self.backup or "neural"


@no_type_check  # validates itself, as SamplingParams
@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Static shapes of the decode engine. Shapes are bucketed so that a run compiles once."""

    max_batch: int = 8
    max_seq_len: int = 1024
    prefill_bucket: int = 64  # prompt lengths are padded up to a multiple of this
    sync_every: int = 8  # decode steps dispatched before the host reads tokens (EOS check)
    sync_phases: bool = False  # SD/SSD: block between draft and verify to time each phase
    mesh: tuple[int, int] | None = None  # (target devices, draft devices); None: default device
    driver: str = "auto"  # SSD: "single" (one process) | "processes" (draft in its own process)
    # "processes" driver: CPU devices per worker process. Each side is tensor-parallel over its
    # process's devices (the layout of a GPU host per side); 1 is fastest on a CPU.
    worker_devices: int = 1
    # Seeds the per-request seeds of SamplingParams without one: a run is reproducible while
    # its rows sample independently. None: fresh OS entropy for every LLM.
    seed: int | None = 0
    # Cut the draft's LM head to this many columns: the most frequent tokens (loading/
    # token_freq.py) plus one never-proposed column. A large vocabulary's head is a big share
    # of a small draft's step (Qwen2.5-0.5B, one pinned core, the engine's start-up step
    # costs: 53 vs 70 ms per token with 32768 of 151936 columns); None keeps it whole.
    draft_vocab: int | None = None
    # More rows than max_batch in one generate call: decode them as one continuous batch of
    # max_batch slots, a row joining as soon as another ends (in this process, the worker
    # processes or a pod). False: consecutive batches.
    continuous: bool = True
    # fp32 products on one CPU device by ssd-jax's own kernel (kernels/cpu.py; the 1.5B target
    # on one vCPU, bench.verify_cost: scoring 5 tokens 218 ms against 579 with XLA's, one
    # token 218 against 278).
    # It is compiled at first use by the machine's C++ compiler; without one, XLA's (a warning
    # says so). False: XLA's everywhere.
    cpu_kernels: bool = True
    # The draft's form on the CPU kernel: "bf16" rounds its weights and the products' inputs to
    # bf16 (fp32 sums). Lossless: verification uses the q each token was drawn from, so it
    # is only another draft, ~1.7x cheaper a step (Qwen2.5-0.5B, one vCPU, 1-6 rows, 40-47 ms
    # against 71-86: half the bytes to stream, twice the products per instruction where the
    # CPU has AVX512-BF16). The target always keeps fp32.
    draft_precision: str = "fp32"

    def __post_init__(self):
        if self.draft_precision not in ("fp32", "bf16"):
            raise ValueError(f"draft_precision={self.draft_precision!r} is unknown: use 'fp32' or "
                             "'bf16'")
        if self.draft_vocab is not None:
            _require_ints(self, "draft_vocab")
            if self.draft_vocab < 3:
                raise ValueError(f"draft_vocab={self.draft_vocab} is invalid: give the number of "
                                 "LM-head columns to keep (e.g. 32768), or None for all")
        if not isinstance(self.continuous, bool):
            raise ValueError(f"continuous={self.continuous!r} is invalid: pass True or False")
        sizes = ("max_batch", "max_seq_len", "prefill_bucket", "sync_every", "worker_devices")
        _require_ints(self, *sizes)
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: it must be >= 1")
        if self.mesh is not None and (len(self.mesh) != 2 or min(self.mesh) < 1):
            raise ValueError(f"mesh={self.mesh} is invalid: give (target devices, draft devices),"
                             " each >= 1")
        if self.driver not in ("auto", "single", "processes"):
            raise ValueError(f"driver={self.driver!r}: use 'auto', 'single' or 'processes'")
        if self.mesh is not None and self.driver == "processes":
            raise ValueError(
                f"mesh={self.mesh} with driver='processes': the worker processes lay out their "
                "own devices (worker_devices per side); drop mesh, or use driver='single'")
        _check_seed(self.seed)
