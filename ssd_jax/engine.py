"""The user-facing engine: `LLM(model).generate(prompts, SamplingParams(...))` and `stream(...)`.

Load once, generate many times. Prompts in a batch may differ in length (right-padded to a
bucket); shapes are bucketed so repeated calls reuse compiled programs.
"""
from __future__ import annotations

import hashlib
import logging
import numbers
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence, no_type_check


import jax
import numpy as np

from ssd_jax import autotune
from ssd_jax.ar import ar_loop
from ssd_jax.batch import make_batch, round_up
from ssd_jax.config import EngineConfig, SamplingParams, SpecConfig
from ssd_jax.loading import check_same_vocabulary, describe, load
from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.metrics import RunMetrics
from ssd_jax.models.transformer import Transformer
from ssd_jax.runner import ModelRunner
from ssd_jax.sd import sd_loop
from ssd_jax.sharding import split_devices
from ssd_jax.ssd import Placement, ssd_loop

Prompt = str | Sequence[int] | np.ndarray | list[dict]  # text, token ids, or chat messages
log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (stop/EOS token) or "length" (max_new_tokens)
    metrics: RunMetrics | None = field(default=None, repr=False)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _prompt_kind(prompt) -> str | None:
    """"text", "ids" (a 1-D sequence of integers) or "chat" (a list of message dicts); None
    when `prompt` is none of these (e.g. a batch of prompts)."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, np.ndarray):
        return "ids" if prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer) else None
    if isinstance(prompt, (list, tuple)) and prompt:
        if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            return "ids"
        if all(isinstance(m, dict) for m in prompt):
            return "chat"
    return None


def _check_messages(messages: list[dict]) -> None:
    for m in messages:
        if m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {_short(m)} is invalid: each message needs a 'role' "
                             f"({', '.join(CHAT_ROLES)}) and a text 'content'")


def _short(x, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[:n - 3] + "..."


def vocab_from_extra(extra: dict):
    """The draft->target vocab map stored with a draft checkpoint, if any."""
    if not extra.get("vocab_map"):
        return None
    from ssd_jax.draft_vocab import VocabMap
    return VocabMap.from_dict(extra["vocab_map"])


def pair_vocab(target: tuple, draft: tuple):
    """The draft->target vocab map of a pair, from their `describe` triples: the one stored with
    a truncated-vocabulary draft, an identity that drops vocabulary padding, or None (same ids).
    Raises when the two tokenizers differ."""
    (t_config, t_tok, _), (d_config, d_tok, extra) = target, draft
    vocab = vocab_from_extra(extra)
    if vocab is None:
        return check_same_vocabulary(t_config, t_tok, d_config, d_tok)
    if vocab.target_size != t_config.vocab_size:
        raise ValueError(
            f"draft vocabulary map targets {vocab.target_size} ids, the target has "
            f"{t_config.vocab_size}: this draft was made for another target")
    return vocab


def _check_addressable(split, mesh) -> None:
    """The decode loops drive their meshes from this process: refuse a split that spans
    devices of other processes (a multi-host job) with the ways that do work."""
    if split is None or jax.process_count() == 1:
        return
    foreign = [d for m in (split.target, split.draft) for d in m.devices.flat
               if d.process_index != jax.process_index()]
    if foreign:
        raise NotImplementedError(
            f"mesh={mesh} spans {len(foreign)} devices of other processes: decode loops over "
            f"several hosts are not implemented yet. Use a mesh within this process's "
            f"{jax.local_device_count()} devices, or set SSD_JAX_DISTRIBUTED=0 and run one "
            f"engine per host")


class LLM:
    """A target model (and later a draft) loaded once, with its tokenizer and jitted programs.

    `model` is a name ("smollm2"), a .gguf file, an HF directory or an ssd_jax orbax directory;
    or an already built `Transformer` (then pass `tokenizer`, or give token-id prompts).
    """

    # The public methods check their own arguments, with errors that name the fix; the test
    # run's type-check hook (tests/conftest.py) is kept off them, or it would pre-empt those.
    @no_type_check
    def __init__(self, model: str | Path | Transformer = "smollm2", *,
                 draft: str | Path | Transformer | None = None,
                 tokenizer: Tokenizer | None = None, dtype: str = "float32",
                 spec: SpecConfig = SpecConfig(), engine: EngineConfig = EngineConfig(),
                 cache_dir: Path | None = None, progress: bool = True):
        for name, value, cls in (("spec", spec, SpecConfig), ("engine", engine, EngineConfig)):
            if not isinstance(value, cls):
                raise ValueError(f"{name}={_short(value)} is invalid: pass "
                                 f"{name}={cls.__name__}(...)")
        # Names/paths let worker processes load the same models (the "processes" driver).
        self.paths = (None if isinstance(model, Transformer) else str(model),
                      None if draft is None or isinstance(draft, Transformer) else str(draft))
        self.dtype, self.cache_dir, self.progress, self.pool = dtype, cache_dir, progress, None
        self.engine, self.spec = engine, spec
        # Weights are loaded on first use in this process: with the worker-process driver only
        # the workers hold them, so the caller never keeps a second copy (a 1.5B target is
        # 7 GB in fp32). Config and tokenizer are read now, from metadata alone.
        self._model = self._draft_model = None
        self._runners: dict[str, ModelRunner] = {}
        if isinstance(model, Transformer):
            self._model, self.tokenizer, self.config = model, tokenizer, model.config
            target = (model.config, tokenizer, {})
        else:
            target = describe(model, dtype=dtype, cache_dir=cache_dir)
            self.config, self.tokenizer, extra = target
            if vocab_from_extra(extra) is not None:
                raise ValueError(
                    f"{model!r} is a draft with a truncated vocabulary (its ids map to a "
                    "target's): it cannot be the target; use it as a draft, e.g. "
                    f"LLM('smollm2', draft={str(model)!r})")
        # Seeds for requests that bring none (drawn in the order requests arrive).
        self._seeds = np.random.default_rng(engine.seed)
        self.split = split_devices(*engine.mesh) if engine.mesh else None
        _check_addressable(self.split, engine.mesh)
        self.has_draft, self.vocab = draft is not None, None
        if draft is not None:
            if isinstance(draft, Transformer):
                self._draft_model = draft
                described = (draft.config, None, {})
            else:
                described = describe(draft, dtype=dtype, cache_dir=cache_dir)
            self.vocab = pair_vocab(target, described)
        self.last_metrics: RunMetrics | None = None  # of the latest generate/stream call
        self.last_choice: autotune.Choice | None = None  # automatic settings of the latest run
        self._logged_choice: autotune.Choice | None = None

    # ---------------------------------------------------------------- models, loaded on use
    @property
    def model(self) -> Transformer:
        if self._model is None:
            self._model = load(self.paths[0], dtype=self.dtype, cache_dir=self.cache_dir,
                               progress=self.progress)[0]
        return self._model

    def _draft(self) -> Transformer:
        if self._draft_model is None:
            self._draft_model = load(self.paths[1], dtype=self.dtype, cache_dir=self.cache_dir,
                                     progress=self.progress)[0]
        return self._draft_model

    def _runner(self, role: str, make) -> ModelRunner:
        if role not in self._runners:
            self._runners[role] = make()
        return self._runners[role]

    @property
    def runner(self) -> ModelRunner:
        """The target's programs on the target mesh."""
        return self._runner("target", lambda: ModelRunner(self.model,
                                                          self.split and self.split.target))

    @property
    def draft_runner(self) -> ModelRunner | None:
        """SSD's draft on the draft mesh (None without a draft)."""
        if not self.has_draft:
            return None
        return self._runner("draft", lambda: ModelRunner(self._draft(),
                                                         self.split and self.split.draft))

    @property
    def sd_draft_runner(self) -> ModelRunner:
        """SD's draft shares the target mesh (SD and AR use the target's devices only)."""
        if self.split is None:
            return self.draft_runner
        return self._runner("sd_draft", lambda: ModelRunner(self._draft(), self.split.target))

    # ---------------------------------------------------------------- prompts and validation
    def _encode(self, prompt: object, chat: bool) -> list[int]:
        """One user prompt -> token ids; anything that is not a `Prompt` is refused here."""
        kind = _prompt_kind(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) == 0:
            raise ValueError("prompt is empty: give at least one token")
        if kind is None:
            raise ValueError(f"prompt {_short(prompt)} is not a prompt: give text, a list of "
                             "token ids, or chat messages [{'role': 'user', 'content': '...'}]")
        if kind == "ids":
            ids = [int(t) for t in prompt]
        else:
            if kind == "text" and not prompt:
                raise ValueError("prompt is empty: give at least one character or token")
            if kind == "chat":
                _check_messages(prompt)
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer: pass prompts as token-id lists")
            if kind == "chat" or chat:
                messages = prompt if kind == "chat" else [{"role": "user", "content": prompt}]
                text = self.tokenizer.apply_chat_template(messages)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.tokenizer.encode(prompt)
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the model's vocabulary "
                             f"[0, {self.config.vocab_size}): give ids of this model's tokenizer")
        return ids

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        eos = [] if p.ignore_eos else list(self.config.eos_token_ids or ())
        if not p.ignore_eos and self.tokenizer is not None:
            eos += list(self.tokenizer.eos_token_ids)
        return sorted(set(eos) | set(p.stop_token_ids))

    def _check_batch(self, ids: list[list[int]], params: list[SamplingParams], mode: str,
                     k: int = 0) -> int:
        if len(ids) > self.engine.max_batch:
            raise ValueError(f"batch of {len(ids)} prompts exceeds max_batch="
                             f"{self.engine.max_batch}: split the batch or raise "
                             "EngineConfig(max_batch=...)")
        need = max(len(t) + p.max_new_tokens for t, p in zip(ids, params))
        limit = min(self.engine.max_seq_len, self.config.max_position_embeddings)
        if mode != "ar" and need + k + 1 > limit >= need:
            raise ValueError(f"K={k} needs K+1={k + 1} slots of cache slack "
                             f"past the {need} positions of prompt + max_new_tokens, beyond the "
                             f"context of {limit}: lower K or max_new_tokens, or raise "
                             "EngineConfig(max_seq_len=...)")
        if need > limit:
            longest = max(len(t) for t in ids)
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens needs {need} positions, "
                             f"more than the context of {limit}: shorten the prompt, lower "
                             "max_new_tokens or raise EngineConfig(max_seq_len=...)")
        return need

    # ---------------------------------------------------------------- decode loops
    def _resolve_mode(self, mode: str | None) -> str:
        mode = mode or ("sd" if self.has_draft else "ar")
        if mode not in ("ar", "sd", "ssd"):
            raise ValueError(f"mode={mode!r} is unknown: use 'ar', 'sd' or 'ssd'")
        if mode != "ar" and not self.has_draft:
            raise ValueError(f"mode={mode!r} needs a draft model: LLM(target, draft=...)")
        return mode

    def driver(self, mode: str) -> str:
        """Where a run executes: "single" (this process) or "processes" (pinned workers)."""
        d = self.engine.driver
        if d == "auto":
            # On CPU one process cannot run draft and target concurrently (XLA:CPU spreads
            # each computation over all cores), so SSD uses two pinned processes there.
            d = ("processes" if mode == "ssd" and jax.default_backend() == "cpu"
                 and None not in self.paths and self.split is None else "single")
        if d == "processes" and None in self.paths:
            raise ValueError("driver='processes' needs the target and draft given by name or "
                             "path (worker processes load them): pass strings, not models")
        return d

    def close(self) -> None:
        """Stop worker processes, if any were started."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _workers(self):
        from ssd_jax.pool import WorkerPool
        if self.pool is None:
            self.pool = WorkerPool(self.paths[0], self.paths[1], dtype=self.dtype,
                                   devices_per_worker=self.engine.worker_devices)
        return self.pool

    # ---------------------------------------------------------------- automatic settings
    def _step_costs(self, mode: str, rows: int) -> autotune.StepCosts:
        """Measured once per machine, pair, batch bucket and device split; then read back."""
        driver = self.driver(mode)
        names = [p or f"model-{hashlib.sha1(repr(c).encode()).hexdigest()[:10]}" for p, c in
                 zip(self.paths, (self.config, self._draft_model and self._draft_model.config))]
        split = driver if self.engine.mesh is None else f"{driver}:{self.engine.mesh}"
        key = autotune.cache_key(*names, rows, self.dtype, split)
        store = autotune.TuneStore(autotune.store_path(self.cache_dir))
        costs = store.costs(key)
        if costs is None:
            log.info("measuring the target's scoring cost and the draft's step cost (batch %d, "
                     "once per machine and pair) ...", rows)
            if driver == "processes":
                costs = self._workers().step_costs(rows)
            else:
                costs = autotune.StepCosts(
                    autotune.time_scoring(self.runner, rows, autotune.TARGET_TOKENS),
                    autotune.time_scoring(self.draft_runner, rows, autotune.DRAFT_TOKENS))
            store.save_costs(key, costs, note=f"{names[0]} + {names[1]}, batch {rows}, {split}")
        return costs

    def _spec_for(self, mode: str, rows: int) -> SpecConfig:
        """The settings of this run: the user's, or chosen through the speed model."""
        self.last_choice = None
        if mode == "ar" or not self.spec.auto:
            return replace(self.spec, backup=self.spec.backup_or_default)
        pair = autotune.pair_key(*(p or "model" for p in self.paths))
        a, r = autotune.TuneStore(autotune.store_path(self.cache_dir)).acceptance(pair)
        choice = autotune.choose(self._step_costs(mode, rows), a=a, r=r, batch=rows, mode=mode)
        if choice != self._logged_choice:  # warmup and the run choose alike: say it once
            log.info("automatic settings (%s): %s", mode.upper(), choice.describe())
            self._logged_choice = choice
        self.last_choice = choice
        return replace(self.spec, k=choice.k, budget=choice.budget,
                       backup=self.spec.backup or choice.backup)

    def _learn(self, mode: str, metrics: RunMetrics) -> None:
        """Keep this pair's measured acceptance for the next automatic choice."""
        if mode == "ar" or sum(metrics.accept_hist) < 8:
            return
        a = autotune.acceptance_from_rounds(metrics.accept_hist)
        pair = autotune.pair_key(*(p or "model" for p in self.paths))
        autotune.TuneStore(autotune.store_path(self.cache_dir)).observe(pair, a)

    def _run_in_workers(self, ids, params, mode, seq_len, spec: SpecConfig):
        request = dict(mode=mode, ids=ids, params=[asdict(p) for p in params],
                       stops=[self._stop_ids(p) for p in params],
                       prefill_bucket=self.engine.prefill_bucket, spec=asdict(spec),
                       seq_len=seq_len, sync_every=self.engine.sync_every,
                       backup=spec.backup)
        pool = self._workers()
        metrics = RunMetrics(mode=mode, batch=len(ids), settings=self._settings(spec, mode))
        run = pool.run(request)
        while True:
            try:
                chunk = next(run)
            except StopIteration as stop:
                # new_tokens is counted here, on the host that cuts rows at their stop.
                metrics.__dict__.update({k: v for k, v in stop.value.__dict__.items()
                                         if k not in ("new_tokens", "settings")})
                return
            yield chunk, metrics

    def _run(self, ids: list[list[int]], params: list[SamplingParams], mode: str
             ) -> Iterator[tuple[list[list[int]], RunMetrics]]:
        """Yields (new tokens per real row, metrics) chunk by chunk."""
        self._check_batch(ids, params, mode)  # batch size and context, before any measuring
        batch = make_batch(ids, params, [self._stop_ids(p) for p in params],
                           self.engine.prefill_bucket)
        spec = self._spec_for(mode, batch.size)
        need = self._check_batch(ids, params, mode, spec.k or 0)
        # Speculative modes write K+1 slots past the committed length each round.
        slack = spec.k + 2 if mode != "ar" else 1
        seq_len = round_up(max(need, batch.tokens.shape[1]) + slack, 256)
        if self.driver(mode) == "processes":
            yield from self._run_in_workers(ids, params, mode, seq_len, spec)
            return
        metrics = RunMetrics(mode=mode, batch=len(ids), sync_phases=self.engine.sync_phases,
                             k=spec.k if mode != "ar" else 0, settings=self._settings(spec, mode))
        if self.split is not None:
            batch = batch.place(self.split.target_replicated)
        cache = self.runner.new_cache(batch.size, seq_len)
        if mode == "ar":
            chunks = ar_loop(self.runner, batch, cache, metrics, self.engine.sync_every)
        elif mode == "sd":
            draft_cache = self.sd_draft_runner.new_cache(batch.size, seq_len)
            chunks = sd_loop(self.runner, self.sd_draft_runner, self.vocab, batch, cache,
                             draft_cache, spec.k, metrics, self.engine.sync_every)
        else:
            draft_cache = self.draft_runner.new_cache(batch.size, seq_len)
            placement = Placement() if self.split is None else Placement(
                self.split.target_replicated, self.split.draft_replicated)
            chunks = ssd_loop(self.runner, self.draft_runner, self.vocab, batch, cache,
                              draft_cache, spec, metrics, self.engine.sync_every,
                              placement=placement, backup=spec.backup)
        for chunk in chunks:
            yield chunk, metrics

    def _settings(self, spec: SpecConfig, mode: str) -> dict | None:
        """What ran, for metrics and bench results: settings and, when chosen, the prediction."""
        if mode == "ar":
            return None
        out = dict(k=spec.k, budget=spec.branches, fanout=spec.fanout, backup=spec.backup,
                   c=spec.c, automatic=self.last_choice is not None)
        if self.last_choice is not None:
            out.update(predicted_tok_s=self.last_choice.tok_s[mode],
                       predicted=self.last_choice.tok_s, a_prior=self.last_choice.a,
                       fanout_lists=self.last_choice.fanout)
        return out

    def _collect(self, ids, params, mode
                 ) -> Iterator[tuple[list[list[int]], list[str | None], RunMetrics]]:
        """Per-row token lists grown chunk by chunk, cut at the stop token / budget."""
        out: list[list[int]] = [[] for _ in ids]
        reason: list[str | None] = [None] * len(ids)
        stops = [set(self._stop_ids(p)) for p in params]
        for toks, metrics in self._run(ids, params, mode):
            for i in range(len(ids)):
                for t in toks[i]:
                    if reason[i] is not None:
                        break
                    out[i].append(int(t))
                    if int(t) in stops[i]:
                        reason[i] = "stop"
                    elif len(out[i]) >= params[i].max_new_tokens:
                        reason[i] = "length"
            metrics.new_tokens = sum(len(o) for o in out)
            self.last_metrics = metrics
            yield out, reason, metrics
        self._learn(mode, metrics)

    def _prepare(self, prompts, sampling_params, chat):
        if _prompt_kind(prompts) is not None:  # one prompt, not a batch
            prompts = [prompts]
        elif isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)  # a [batch, length] array of token ids
        prompts = list(prompts) if isinstance(prompts, (list, tuple)) else prompts
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("no prompts given: pass a prompt or a list with at least one prompt")
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams (one, or one per "
                                 f"prompt), not {type(p).__name__}: e.g. SamplingParams("
                                 "max_new_tokens=64)")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, "
                             "or one per prompt")
        # One shared default seed would give every row of a batch the same random stream
        # (identical samples for identical prompts): unseeded requests get their own.
        params = [p if p.seed is not None
                  else replace(p, seed=int(self._seeds.integers(2**32))) for p in params]
        return [self._encode(p, chat) for p in prompts], params

    def _text(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    # ---------------------------------------------------------------- public API
    @no_type_check
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 *, chat: bool = True, mode: str | None = None) -> list[RequestOutput]:
        """Generate for a batch of prompts. Strings go through the chat template unless
        chat=False; token-id lists are used as they are. mode: "ar", "sd" or "ssd" (default:
        "sd" when a draft is loaded, else "ar")."""
        mode = self._resolve_mode(mode)
        ids, params = self._prepare(prompts, sampling_params, chat)
        out = reason = metrics = None
        for out, reason, metrics in self._collect(ids, params, mode):
            pass
        return [RequestOutput(ids[i], out[i], self._text(out[i]), reason[i] or "length", metrics)
                for i in range(len(ids))]

    @no_type_check
    def warmup(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams = SamplingParams(), *, chat: bool = True,
               mode: str | None = None) -> float:
        """Compile the programs a `generate` of these prompts will use (prefill and the decode
        step at the same shape buckets) by running its first chunk. Returns seconds spent."""
        t0 = time.perf_counter()
        mode = self._resolve_mode(mode)
        ids, params = self._prepare(prompts, sampling_params, chat)
        for i, _ in enumerate(self._run(ids, params, mode)):
            if i == 1:
                break
        return time.perf_counter() - t0

    @no_type_check
    def stream(self, prompt: Prompt, sampling_params: SamplingParams = SamplingParams(),
               *, chat: bool = True, mode: str | None = None) -> Iterator[str]:
        """Yield text pieces of one request as they are decoded."""
        if _prompt_kind(prompt) is None:
            raise ValueError("stream() takes one prompt (text, token ids or chat messages); "
                             "use generate() for a batch")
        mode = self._resolve_mode(mode)
        ids, params = self._prepare([prompt], sampling_params, chat)
        shown = ""
        for out, _, _ in self._collect(ids, params, mode):
            text = self._text(out[0])
            # Hold back a trailing replacement char: a multi-byte character may be incomplete.
            stable = text[:-1] if text.endswith("\ufffd") else text
            if len(stable) > len(shown):
                yield stable[len(shown):]
                shown = stable
        self.last_token_ids = list(out[0])  # of this stream, for callers that compare runs
        final = self._text(out[0])
        if len(final) > len(shown):
            yield final[len(shown):]
