"""The user-facing engine: `LLM(model).generate(prompts, SamplingParams(...))` and `stream(...)`.

Load once, generate many times. Prompts in a batch may differ in length (right-padded to a
bucket); shapes are bucketed so repeated calls reuse compiled programs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.config import EngineConfig, SamplingParams
from ssd_jax.loading import load
from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.metrics import RunMetrics
from ssd_jax.models.transformer import Transformer
from ssd_jax.runner import ModelRunner, RowSampling

Prompt = str | Sequence[int] | list[dict]  # text, token ids, or chat messages


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (stop/EOS token) or "length" (max_new_tokens)
    metrics: RunMetrics | None = field(default=None, repr=False)


def _round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


class LLM:
    """A target model (and later a draft) loaded once, with its tokenizer and jitted programs.

    `model` is a name ("smollm2"), a .gguf file, an HF directory or an ssd_jax orbax directory;
    or an already built `Transformer` (then pass `tokenizer`, or give token-id prompts).
    """

    def __init__(self, model: str | Path | Transformer = "smollm2", *,
                 tokenizer: Tokenizer | None = None, dtype: str = "float32",
                 engine: EngineConfig = EngineConfig(), cache_dir: Path | None = None):
        if isinstance(model, Transformer):
            self.model, self.tokenizer = model, tokenizer
        else:
            self.model, self.tokenizer, _ = load(model, dtype=dtype, cache_dir=cache_dir,
                                                 progress=True)
        self.engine = engine
        self.runner = ModelRunner(self.model)
        self.config = self.model.config
        self.last_metrics: RunMetrics | None = None  # of the latest generate/stream call

    # ---------------------------------------------------------------- prompts and validation
    def _encode(self, prompt: Prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                       and isinstance(prompt[0], dict)):
            if isinstance(prompt, str) and not prompt:
                raise ValueError("prompt is empty: give at least one character or token")
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer: pass prompts as token-id lists")
            if chat:
                messages = prompt if isinstance(prompt, list) else [
                    {"role": "user", "content": prompt}]
                text = self.tokenizer.apply_chat_template(messages)
                return self.tokenizer.encode(text, add_special_tokens=False)
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        return ids

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        eos = [] if p.ignore_eos else list(self.config.eos_token_ids or ())
        if not p.ignore_eos and self.tokenizer is not None:
            eos += list(self.tokenizer.eos_token_ids)
        return sorted(set(eos) | set(p.stop_token_ids))

    def _check_batch(self, ids: list[list[int]], params: list[SamplingParams]) -> int:
        if len(ids) > self.engine.max_batch:
            raise ValueError(f"batch of {len(ids)} prompts exceeds max_batch="
                             f"{self.engine.max_batch}: split the batch or raise "
                             "EngineConfig(max_batch=...)")
        need = max(len(t) + p.max_new_tokens for t, p in zip(ids, params))
        limit = min(self.engine.max_seq_len, self.config.max_position_embeddings)
        if need > limit:
            longest = max(len(t) for t in ids)
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens needs {need} positions, "
                             f"more than the context of {limit}: shorten the prompt, lower "
                             "max_new_tokens or raise EngineConfig(max_seq_len=...)")
        return need

    # ---------------------------------------------------------------- decode loop
    def _batch_arrays(self, ids, params):
        # Pad the batch to a power of two with copies of row 0 that stop after one token, so
        # batches of 3 and 4 share one compiled program.
        B = 1 << (len(ids) - 1).bit_length()
        ids = list(ids) + [ids[0]] * (B - len(ids))
        params = list(params) + [SamplingParams(max_new_tokens=1)] * (B - len(params))
        T = _round_up(max(len(t) for t in ids), self.engine.prefill_bucket)
        tokens = np.zeros((B, T), np.int32)
        for i, t in enumerate(ids):
            tokens[i, :len(t)] = t
        prompt_len = np.array([len(t) for t in ids], np.int32)
        stops = [self._stop_ids(p) for p in params]
        width = max(1, max(len(s) for s in stops))
        stop_ids = np.full((B, width), -1, np.int32)
        for i, s in enumerate(stops):
            stop_ids[i, :len(s)] = s
        sampling = RowSampling(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            keys=jax.vmap(jax.random.key)(jnp.asarray([p.seed for p in params], jnp.uint32)))
        max_new = np.array([p.max_new_tokens for p in params], np.int32)
        return tokens, prompt_len, sampling, stop_ids, max_new

    def _run(self, ids: list[list[int]], params: list[SamplingParams]
             ) -> Iterator[tuple[np.ndarray, np.ndarray, RunMetrics]]:
        """Yields (tokens [B, n], done [B]) chunks as the host reads them."""
        need = self._check_batch(ids, params)
        tokens, prompt_len, sampling, stop_ids, max_new = self._batch_arrays(ids, params)
        seq_len = _round_up(max(need, tokens.shape[1]) + 1, 256)
        metrics = RunMetrics(mode="ar", batch=len(ids))
        cache = self.runner.new_cache(tokens.shape[0], seq_len)
        t0 = time.perf_counter()
        state, cache = self.runner.prefill(jnp.asarray(tokens), jnp.asarray(prompt_len), cache,
                                           sampling, jnp.asarray(stop_ids), jnp.asarray(max_new))
        first = np.asarray(state.tokens)  # TTFT includes the first token's transfer
        metrics.ttft_s = time.perf_counter() - t0
        yield first[:len(ids), None], np.asarray(state.done)[:len(ids)], metrics
        steps = int(max_new[:len(ids)].max()) - 1
        stop_ids, max_new = jnp.asarray(stop_ids), jnp.asarray(max_new)
        t1 = time.perf_counter()
        done_step = 0
        while done_step < steps:
            chunk = []
            # Dispatch a few steps before reading: the host never waits inside the chunk.
            for _ in range(min(self.engine.sync_every, steps - done_step)):
                state, cache = self.runner.decode(state, cache, sampling, stop_ids, max_new)
                chunk.append((state.tokens, state.done))
            done_step += len(chunk)
            toks = np.stack([np.asarray(t)[:len(ids)] for t, _ in chunk], axis=1)
            done = np.asarray(chunk[-1][1])[:len(ids)]
            metrics.decode_steps += len(chunk)
            metrics.decode_s = time.perf_counter() - t1
            yield toks, done, metrics
            if done.all():
                break

    def _collect(self, ids, params) -> Iterator[tuple[list[list[int]], list[str | None], RunMetrics]]:
        """Per-row token lists grown chunk by chunk, cut at the stop token / budget."""
        out: list[list[int]] = [[] for _ in ids]
        reason: list[str | None] = [None] * len(ids)
        stops = [set(self._stop_ids(p)) for p in params]
        for toks, _, metrics in self._run(ids, params):
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

    def _prepare(self, prompts, sampling_params, chat):
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given: pass a list with at least one prompt")
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, "
                             "or one per prompt")
        return [self._encode(p, chat) for p in prompts], params

    def _text(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    # ---------------------------------------------------------------- public API
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 *, chat: bool = True) -> list[RequestOutput]:
        """Generate for a batch of prompts. Strings go through the chat template unless
        chat=False; token-id lists are used as they are."""
        ids, params = self._prepare(prompts, sampling_params, chat)
        out = reason = metrics = None
        for out, reason, metrics in self._collect(ids, params):
            pass
        return [RequestOutput(ids[i], out[i], self._text(out[i]), reason[i] or "length", metrics)
                for i in range(len(ids))]

    def warmup(self, prompts, sampling_params: SamplingParams = SamplingParams(), *,
               chat: bool = True) -> float:
        """Compile the programs a `generate` of these prompts will use (prefill and the decode
        step at the same shape buckets) by running its first chunk. Returns seconds spent."""
        t0 = time.perf_counter()
        ids, params = self._prepare(prompts, sampling_params, chat)
        for i, _ in enumerate(self._run(ids, params)):
            if i == 1:
                break
        return time.perf_counter() - t0

    def stream(self, prompt: Prompt, sampling_params: SamplingParams = SamplingParams(),
               *, chat: bool = True) -> Iterator[str]:
        """Yield text pieces of one request as they are decoded."""
        ids, params = self._prepare([prompt], sampling_params, chat)
        shown = ""
        for out, _, _ in self._collect(ids, params):
            text = self._text(out[0])
            # Hold back a trailing replacement char: a multi-byte character may be incomplete.
            stable = text[:-1] if text.endswith("\ufffd") else text
            if len(stable) > len(shown):
                yield stable[len(shown):]
                shown = stable
        final = self._text(out[0])
        if len(final) > len(shown):
            yield final[len(shown):]
