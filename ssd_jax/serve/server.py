"""A served model: the LLM (tokenizer, models), its continuous batch and the decode thread."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import numpy as np

from ssd_jax.config import SamplingParams, SpecConfig
from ssd_jax.prompts import check_fits, check_messages, context_room
from ssd_jax.serve.metrics import ServerMetrics
from ssd_jax.serve.protocol import APIError, Job, flag, text_content
from ssd_jax.serve.scheduler import Request, Scheduler

log = logging.getLogger(__name__)


class Server:
    """`llm`: an ssd_jax.LLM (its driver decides where rounds run: this process, the worker
    processes (SSD on a CPU by default) or a pod; the HTTP side is always here); `slots`:
    rows decoding at once; `max_queue`: requests that may wait for a slot (more: 429);
    `max_logprobs`: the most top alternatives per token a request may ask for (the width the
    target's programs return while a request wants log-probabilities; -1: none served);
    `warm_up`: serve short requests of its own before returning (see warm_up)."""

    def __init__(self, llm, *, mode: str, model_name: str, slots: int = 8, max_queue: int = 64,
                 spec: SpecConfig | None = None, max_logprobs: int = 20, warm_up: bool = True):
        self.llm, self.mode, self.model_name, self.slots = llm, mode, model_name, slots
        self.max_logprobs = max_logprobs
        self.created = int(time.time())
        mode = llm.core.resolve_mode(mode)
        self.live, self.spec = llm.core.live(mode, slots, spec or llm.spec)
        self.slots = self.live.slots  # rounded up to a power of two
        self.metrics = ServerMetrics()
        self._seeds = np.random.default_rng()
        self.scheduler = Scheduler(self.live, self._text,
                                   mode, self.spec.k or 0, max_queue=max_queue,
                                   metrics=self.metrics, lp_width=max(max_logprobs, 0))
        self.scheduler.start()
        log.info("serving %s (%s, %d slots%s)", model_name, mode.upper(), slots,
                 "" if mode == "ar" else f", K={self.spec.k}")
        if warm_up:
            self.warm_up()

    def warm_up(self) -> float:
        """Decode a short greedy request (a few rounds, not in /metrics), and one asking for
        log-probabilities, which runs the target's other programs; return their seconds: XLA
        compiles the rounds then, so the first client does not wait for it and a server that
        answers /health serves at full speed. A failed round raises here."""
        log.info("warming up: short requests compile the round")
        t0 = time.perf_counter()
        for logprobs in (None, 0) if self.max_logprobs >= 0 else (None,):
            self._warm_up_one(logprobs)
        seconds = time.perf_counter() - t0
        log.info("warmed up in %.1f s", seconds)
        return seconds

    def _warm_up_one(self, logprobs: int | None) -> None:
        last: list = []
        done = threading.Event()

        def push(event) -> None:
            if event[0] != "delta":
                last.append(event)
                done.set()
        k = self.spec.k or 0
        job = Job("completion", self.model_name, self.llm.prompts.encode("Hello", chat=False),
                  SamplingParams(max_new_tokens=2 * (k + 1) + 1, ignore_eos=True),
                  stream=False, include_usage=False, logprobs=logprobs)
        self.check_request([job])
        self.scheduler.submit(Request(job, push, set(), quiet=True))
        while not done.wait(1.0):
            if not self.scheduler.alive():
                break
        if not last or last[0][0] != "done":
            raise RuntimeError(f"the server's warm-up request failed: "
                               f"{last[0][1] if last else 'the decode thread ended'}")

    def _text(self, ids: list[int]) -> str:
        return self.llm.prompts.text(ids)

    def piece(self, token_id: int) -> tuple[str, bytes]:
        return self.llm.prompts.piece(token_id)

    def encode(self, prompt, chat: bool) -> list[int]:
        if chat and not isinstance(prompt, list):
            raise ValueError("'messages' must be a list of {role, content} messages")
        if not chat and not isinstance(prompt, (str, list)):
            raise ValueError("'prompt' must be a string or a list of token ids")
        return self.llm.prompts.encode(prompt, chat=chat)

    def stop_ids(self, p: SamplingParams) -> set[int]:
        return set(self.llm.prompts.stop_ids(p))

    def check_request(self, jobs: list[Job]) -> None:
        """`check_fits` for each prompt's job of one request, after refusing a request whose
        choices (prompts x n) the queue could never hold at once."""
        rows = len(jobs) * jobs[0].n
        if rows > self.scheduler.max_queue:
            what = (f"'n'={jobs[0].n}" if len(jobs) == 1 else
                    f"{len(jobs)} prompts x 'n'={jobs[0].n}")
            raise APIError(400, f"{what} is more choices than this server queues at once "
                                f"({self.scheduler.max_queue}): ask for fewer, or start it "
                                "with a larger --max-queue", "n" if len(jobs) == 1 else "prompt")
        for job in jobs:
            self.check_fits(job)

    def _room(self) -> tuple[int, int]:
        """(the context a row may use, the speculation slack kept free in it)."""
        return context_room(self.llm.engine, self.llm.config.max_position_embeddings,
                            self.mode, self.spec.k or 0)

    def check_fits(self, job: Job) -> None:
        """Refuse what cannot fit the context, the batch's rows or the server's settings; give
        an unseeded request its own seed (rows sample independently, as offline) and one
        without max_tokens the context left after its prompt. Everything a row's join could
        refuse is refused here, before the request is queued: an error inside the decode
        thread would reach the request late, and its neighbours not at all."""
        if job.params.seed is None:
            job.params = replace(job.params, seed=int(self._seeds.integers(2**32)))
        if job.logprobs is not None and job.logprobs > self.max_logprobs:
            name = "logprobs" if job.kind == "completion" else "top_logprobs"
            raise APIError(400, f"'{name}'={job.logprobs} is more than this server returns "
                                + ("(it was started with --max-logprobs -1: no log-"
                                   "probabilities)" if self.max_logprobs < 0 else
                                   f"({self.max_logprobs}): ask for fewer, or start it with a "
                                   "larger --max-logprobs"), name)
        vocab = self.llm.config.vocab_size
        for name, ids in (("stop_token_ids", job.params.stop_token_ids),
                          ("logit_bias", [t for t, _ in job.params.logit_bias])):
            if any(t >= vocab for t in ids):
                raise APIError(400, f"'{name}' holds ids past the vocabulary ({vocab} tokens): "
                                    "give ids below that", name)
        limit, slack = self._room()
        field = "messages" if job.kind == "chat" else "prompt"
        if len(job.prompt_ids) + 1 + slack > limit:
            raise APIError(400, f"the prompt ({len(job.prompt_ids)} tokens) leaves no room for "
                                f"an answer in the context of {limit} tokens"
                                f"{f' (K+1={slack} of them speculation slack)' if slack else ''}:"
                                " shorten it, or start the server with a larger --max-seq-len",
                           field)
        if not job.max_tokens_given:
            room = limit - slack - len(job.prompt_ids)
            if room < job.params.min_tokens:
                raise APIError(400, f"'min_tokens'={job.params.min_tokens} is more than the "
                                    f"context leaves after the prompt ({room} tokens)",
                               "min_tokens")
            job.params = replace(job.params, max_new_tokens=room)
        try:
            check_fits([job.prompt_ids], [job.params], self.mode, self.llm.engine,
                       self.llm.config.max_position_embeddings, k=self.spec.k or 0)
            self.live.request(job.prompt_ids, job.params, sorted(self.stop_ids(job.params)))
        except ValueError as e:
            msg = str(e).splitlines()[0].replace("max_new_tokens", "max_tokens").replace(
                "EngineConfig(max_seq_len=...)", "the server's --max-seq-len")
            raise APIError(400, msg, "max_tokens" if "max_tokens" in msg else field)

    # ---------------------------------------------------------------- the tokenizer, as vLLM's
    # POST /tokenize, POST /detokenize, GET /tokenizer_info: what lm-evaluation-harness's
    # `tokenizer_backend=remote` reads, so a client needs no copy of the tokenizer.
    def _tokenizer(self):
        tok = self.llm.prompts.tokenizer
        if tok is None:
            raise APIError(400, "this server's model has no tokenizer: send token ids")
        return tok

    def tokenize(self, body) -> dict:
        """{"prompt": text, "add_special_tokens": true} or {"messages": [...],
        "add_generation_prompt": true} -> {"count", "max_model_len", "tokens"}."""
        tok = self._tokenizer()
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if body.get("messages") is not None:
            messages = text_content(body["messages"])
            if not isinstance(messages, list):
                raise APIError(400, "'messages' must be a list of {role, content} messages",
                               "messages")
            try:
                check_messages(messages)
                text = tok.apply_chat_template(messages, add_generation_prompt=flag(
                    body, "add_generation_prompt", True))
            except ValueError as e:
                raise APIError(400, str(e).splitlines()[0], "messages")
            ids = tok.encode(text, add_special_tokens=flag(body, "add_special_tokens", False))
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"],
                             add_special_tokens=flag(body, "add_special_tokens", True))
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages' (chat messages)",
                           "prompt")
        return {"count": len(ids), "max_model_len": self._room()[0], "tokens": ids}

    def detokenize(self, body) -> dict:
        """{"tokens": [ids]} -> {"prompt": text} (special tokens skipped, as answers are)."""
        tok, vocab = self._tokenizer(), self.llm.config.vocab_size
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              and 0 <= t < vocab for t in ids)):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})",
                           "tokens")
        return {"prompt": tok.decode(ids)}

    def tokenizer_info(self) -> dict:
        tok = self._tokenizer()

        def token(i: int | None) -> str | None:
            return None if i is None else tok.backend.id_to_token(int(i))
        return {"tokenizer_class": "ssd_jax.Tokenizer",
                "eos_token": token(tok.eos_token_ids[0] if tok.eos_token_ids else None),
                "bos_token": token(tok.bos_token_id), "pad_token": None,
                "chat_template": tok.chat_template, "model_max_length": self._room()[0]}

    def shutdown(self) -> None:
        self.scheduler.stop()
        self.llm.close()
