"""A served model: the LLM (tokenizer, models), its continuous batch and the decode thread."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from ssd_jax.config import SamplingParams, SpecConfig
from ssd_jax.prompts import check_fits
from ssd_jax.serve.metrics import ServerMetrics
from ssd_jax.serve.protocol import APIError, Job
from ssd_jax.serve.scheduler import Scheduler

log = logging.getLogger(__name__)


class Server:
    """`llm`: an ssd_jax.LLM (run in this process: EngineConfig(driver="single")); `slots`:
    rows decoding at once; `max_queue`: requests that may wait for a slot (more: 429)."""

    def __init__(self, llm, *, mode: str, model_name: str, slots: int = 8, max_queue: int = 64,
                 spec: SpecConfig | None = None):
        self.llm, self.mode, self.model_name, self.slots = llm, mode, model_name, slots
        self.created = int(time.time())
        mode = llm.core.resolve_mode(mode)
        self.live, self.spec = llm.core.live(mode, slots, spec or llm.spec)
        self.slots = self.live.slots  # rounded up to a power of two
        self.metrics = ServerMetrics()
        self._seeds = np.random.default_rng()
        self.scheduler = Scheduler(self.live, self._text,
                                   mode, self.spec.k or 0, max_queue=max_queue,
                                   metrics=self.metrics)
        self.scheduler.start()
        log.info("serving %s (%s, %d slots%s)", model_name, mode.upper(), slots,
                 "" if mode == "ar" else f", K={self.spec.k}")

    def _text(self, ids: list[int]) -> str:
        return self.llm.prompts.text(ids)

    def encode(self, prompt, chat: bool) -> list[int]:
        if chat and not isinstance(prompt, list):
            raise ValueError("'messages' must be a list of {role, content} messages")
        if not chat and not isinstance(prompt, (str, list)):
            raise ValueError("'prompt' must be a string or a list of token ids")
        return self.llm.prompts.encode(prompt, chat=chat)

    def stop_ids(self, p: SamplingParams) -> set[int]:
        return set(self.llm.prompts.stop_ids(p))

    def check_fits(self, job: Job) -> None:
        """Refuse what cannot fit the context; give an unseeded sampled request its own seed
        (rows sample independently, as offline)."""
        if job.params.seed is None:
            job.params = replace(job.params, seed=int(self._seeds.integers(2**32)))
        cfg = self.llm.engine
        try:
            check_fits([job.prompt_ids], [job.params], self.mode, cfg,
                       self.llm.config.max_position_embeddings, k=self.spec.k or 0)
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0], "max_tokens")

    def shutdown(self) -> None:
        self.scheduler.stop()
        self.llm.close()
