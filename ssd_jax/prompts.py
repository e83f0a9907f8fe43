"""User prompts -> token ids: the prompt forms `LLM` accepts, their checks, stop ids, per-request
seeds, and the batch/context limits a request must fit. No model is loaded here."""
from __future__ import annotations

import numbers
from dataclasses import replace
from typing import Sequence

import numpy as np

from ssd_jax.config import EngineConfig, ModelConfig, SamplingParams, choice_seed
from ssd_jax.loading.tokenizer import Tokenizer

Prompt = str | Sequence[int] | np.ndarray | list[dict]  # text, token ids, or chat messages
CHAT_ROLES = ("system", "user", "assistant", "tool")


def prompt_kind(prompt) -> str | None:
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


def check_messages(messages: list[dict]) -> None:
    for m in messages:
        if m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {short(m)} is invalid: each message needs a 'role' "
                             f"({', '.join(CHAT_ROLES)}) and a text 'content'")


def short(x, n: int = 60) -> str:
    """repr(x) cut to n characters, for error messages that quote a user's value."""
    r = repr(x)
    return r if len(r) <= n else r[:n - 3] + "..."


def context_room(engine: EngineConfig, max_positions: int, mode: str, k: int) -> tuple[int, int]:
    """(limit, slack): the positions a row may use (the engine's cache or the model's
    positions, whichever is fewer), and how many of them SD/SSD keep free past the answer for
    the K+1 tokens a round may write beyond it."""
    return min(engine.max_seq_len, max_positions), 0 if mode == "ar" else k + 1


def check_fits(ids: list[list[int]], params: list[SamplingParams], mode: str,
               engine: EngineConfig, max_positions: int, k: int = 0) -> int:
    """The positions the batch needs (longest prompt + max_new_tokens); raises when the batch
    is larger than max_batch or does not fit the context (with K+1 slots of slack in SD/SSD)."""
    if len(ids) > engine.max_batch:
        raise ValueError(f"batch of {len(ids)} rows (prompts, n answers each) exceeds "
                         f"max_batch={engine.max_batch}: split the batch or raise "
                         "EngineConfig(max_batch=...)")
    need = max(len(t) + p.max_new_tokens for t, p in zip(ids, params))
    limit, slack = context_room(engine, max_positions, mode, k)
    if need + slack > limit >= need:
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


class Prompts:
    """Encodes prompts for one model: its tokenizer (None: token-id prompts only) and config
    (vocabulary size, EOS ids). `seed` seeds the per-request seeds of unseeded requests."""

    def __init__(self, tokenizer: Tokenizer | None, config: ModelConfig, seed: int | None):
        self.tokenizer, self.config = tokenizer, config
        # Seeds for requests that bring none (drawn in the order requests arrive).
        self._seeds = np.random.default_rng(seed)

    def encode(self, prompt: object, chat: bool) -> list[int]:
        """One user prompt -> token ids; anything that is not a `Prompt` is refused here."""
        kind = prompt_kind(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) == 0:
            raise ValueError("prompt is empty: give at least one token")
        if kind is None:
            raise ValueError(f"prompt {short(prompt)} is not a prompt: give text, a list of "
                             "token ids, or chat messages [{'role': 'user', 'content': '...'}]")
        if kind == "ids":
            ids = [int(t) for t in prompt]
        else:
            if kind == "text" and not prompt:
                raise ValueError("prompt is empty: give at least one character or token")
            if kind == "chat":
                check_messages(prompt)
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

    def fill_in_middle(self, prefix: str, suffix: str) -> list[int]:
        """The token ids of a fill-in-the-middle prompt: the model writes what goes between
        `prefix` and `suffix` (prefix-suffix-middle order, as code models are trained)."""
        fim = None if self.tokenizer is None else self.tokenizer.fim_ids()
        if fim is None:
            raise ValueError("this model's tokenizer has no fill-in-the-middle tokens "
                             "(<|fim_prefix|> ..., or <fim_prefix> ...): a suffix needs a code "
                             "model trained for it, e.g. qwen2.5-coder-1.5b")
        if not (isinstance(prefix, str) and isinstance(suffix, str) and (prefix or suffix)):
            raise ValueError("fill-in-the-middle takes a text prefix and a text suffix, not "
                             "both empty")
        tok = self.tokenizer
        bos = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
        ids = (bos + [fim[0]] + tok.encode(prefix, add_special_tokens=False) + [fim[1]]
               + tok.encode(suffix, add_special_tokens=False) + [fim[2]])
        return self.encode(ids, chat=False)  # the vocabulary check

    def stop_ids(self, p: SamplingParams) -> list[int]:
        eos = [] if p.ignore_eos else list(self.config.eos_token_ids or ())
        if not p.ignore_eos and self.tokenizer is not None:
            eos += list(self.tokenizer.eos_token_ids)
        return sorted(set(eos) | set(p.stop_token_ids))

    def prepare(self, prompts, sampling_params, chat: bool, *, draw_seeds: bool = True
                ) -> tuple[list[list[int]], list[SamplingParams]]:
        """One prompt or a batch, with one SamplingParams or one per prompt -> (token ids per
        row, params per row); a prompt whose params ask for n answers is n rows.
        draw_seeds=False leaves unseeded requests as they are (for a look at shapes that must
        not shift the seeds later requests get)."""
        if prompt_kind(prompts) is not None:  # one prompt, not a batch
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
        for p in params:
            bad = [t for t, _ in p.logit_bias if t >= self.config.vocab_size]
            if bad:
                raise ValueError(f"logit_bias ids {bad[:5]} are outside the model's vocabulary "
                                 f"[0, {self.config.vocab_size}): give ids of this model's "
                                 "tokenizer")
            if p.stop and self.tokenizer is None:
                raise ValueError(f"stop={list(p.stop)} needs a tokenizer to find the strings in "
                                 "the text: load the model with one, or stop on token ids "
                                 "(stop_token_ids)")
        if draw_seeds:
            # One shared default seed would give every row of a batch the same random stream
            # (identical samples for identical prompts): unseeded requests get their own.
            params = [p if p.seed is not None
                      else replace(p, seed=int(self._seeds.integers(2**32))) for p in params]
        ids = [self.encode(p, chat) for p in prompts]
        # n answers per prompt: n rows, consecutive, each with its own seed.
        rows = [(t, p if p.n == 1 else replace(
                    p, n=1, seed=None if p.seed is None else choice_seed(p.seed, i)))
                for t, p in zip(ids, params) for i in range(p.n)]
        return [t for t, _ in rows], [p for _, p in rows]

    def text(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """One token as logprobs show it: its text (bytes that do not decode alone as
        U+FFFD) and its bytes; `token_id:N` without a tokenizer, as vLLM writes it."""
        if self.tokenizer is None:
            return f"token_id:{token_id}", b""
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw
