"""Plain autoregressive decoding: one target forward per token (the baseline)."""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ssd_jax.batch import Batch
from ssd_jax.metrics import RunMetrics
from ssd_jax.models.transformer import KVCache
from ssd_jax.runner import ModelRunner


def ar_loop(runner: ModelRunner, batch: Batch, cache: KVCache, metrics: RunMetrics,
            sync_every: int) -> Iterator[list[list[int]]]:
    """Yields, per chunk, each real row's new tokens (rows past their stop keep producing
    filler that the caller cuts off)."""
    t0 = time.perf_counter()
    state, cache = runner.prefill(batch.tokens, batch.prompt_len, cache, batch.sampling,
                                  batch.stop_ids, batch.max_new)
    first = np.asarray(state.tokens)  # TTFT includes the first token's transfer to the host
    metrics.ttft_s = time.perf_counter() - t0
    yield [[int(t)] for t in first[:batch.n]]
    steps, done_steps = batch.max_steps - 1, 0
    t1 = time.perf_counter()
    while done_steps < steps:
        chunk = []
        # Dispatch several steps before reading: the host never waits inside a chunk.
        for _ in range(min(sync_every, steps - done_steps)):
            state, cache = runner.decode(state, cache, batch.sampling, batch.stop_ids,
                                         batch.max_new)
            chunk.append(state)
        done_steps += len(chunk)
        toks = np.stack([np.asarray(s.tokens)[:batch.n] for s in chunk], axis=1)
        done = np.asarray(chunk[-1].done)[:batch.n]
        metrics.decode_steps += len(chunk)
        metrics.decode_s = time.perf_counter() - t1
        yield [row.tolist() for row in toks]
        if done.all():
            return
