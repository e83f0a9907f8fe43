"""Offline continuous batching: `generate` with more rows than EngineConfig.max_batch decodes
them in one live batch (core/live.py) of max_batch slots. A waiting row joins at the round
boundary after a row ends, instead of waiting, as in consecutive batches, for the longest row
of the batch before its own. Rows never see each other in a live batch (attention, sampling
keys and verification are per row), so each row's tokens are those it gives alone.

The chunks have the offline loops' form (rounds.Chunk, one list per row of the call: empty
for rows waiting or ended), so `LLM._collect` cuts them as it cuts any run. The caller says
which rows it has ended (`ended`, checked after each chunk): a stop token and the row's budget
end it on the device too, a stop string only on the host, and either frees its slot.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Iterator

import numpy as np

from ssd_jax.config import MAX_LOGPROBS, SamplingParams
from ssd_jax.core.live import Live
from ssd_jax.core.logprobs import HostLogprobs, with_logprobs
from ssd_jax.core.metrics import RunMetrics, SSDStats
from ssd_jax.core.rounds import Chunk, with_prompt_logprobs


def decode(live: Live, ids: list[list[int]], params: list[SamplingParams],
           stops: list[list[int]], ended: Callable[[int], bool], metrics: RunMetrics
           ) -> Iterator[Chunk]:
    """Rows `ids` (with their `params` and stop ids) through `live`, in order, a row joining
    each free slot; yields a chunk after each round of joins and after each round of decoding.
    `metrics` gets the run's counters (decode_steps are rounds of the whole batch)."""
    wants_lp = [p.logprobs is not None or p.prompt_logprobs is not None for p in params]
    pending = collections.deque(range(len(ids)))
    active: dict[int, int] = {}  # slot -> row
    k = metrics.k
    hist = np.zeros(k + 1, np.int64)
    if live.mode == "ssd":
        metrics.ssd = SSDStats(k=k)
    t0 = time.perf_counter()
    t_first = None
    while pending or active:
        chunk: Chunk = [[] for _ in ids]
        joined = False
        for slot in live.free_slots():
            if not pending:
                break
            if slot in active:  # freed on the host side only after this round's leave
                continue
            i = pending.popleft()
            prompt_lp = params[i].prompt_logprobs is not None
            first, lp = live.join(slot, ids[i], params[i], stops[i],
                                  MAX_LOGPROBS if wants_lp[i] else None, prompt_lp)
            chunk[i] = _first(first, lp, len(ids[i]), prompt_lp)
            active[slot], joined = i, True
        if joined:
            if t_first is None:
                t_first = time.perf_counter()
                metrics.ttft_s = t_first - t0
            yield chunk
            _leave(live, active, ended, None)
        if not active:
            continue
        width = MAX_LOGPROBS if any(wants_lp[i] for i in active.values()) else None
        out, done, hit, lp = live.step(width)
        rows = with_logprobs(out, lp, out.shape[0]) if lp is not None else [
            [int(t) for t in row if t >= 0] for row in out]
        chunk = [[] for _ in ids]
        n = np.full(out.shape[0], -1)
        for slot, i in active.items():
            chunk[i] = rows[slot]
            n[slot] = len(rows[slot]) - 1
        emitted = n >= 0
        if live.mode != "ar":
            np.add.at(hist, n[emitted], 1)
            metrics.accept_hist = hist.tolist()
        if metrics.ssd is not None:
            metrics.ssd.record(np.maximum(n, 0), hit, ~emitted, out.shape[0])
        metrics.decode_steps += 1
        metrics.decode_s = time.perf_counter() - t_first
        yield chunk
        _leave(live, active, ended, done)


def _leave(live: Live, active: dict[int, int], ended: Callable[[int], bool],
           done: np.ndarray | None) -> None:
    """Free the slots of rows ended on the device (`done`) or by the caller."""
    for slot, i in list(active.items()):
        if (done is not None and done[slot]) or ended(i):
            live.leave(slot)
            del active[slot]


def _first(token: int, lp: HostLogprobs | None, prompt_len: int, prompt_lp: bool) -> list:
    """A joining row's first chunk entries: its first token, with its log-probabilities when
    asked (the prefill's lp, [1, 1]), and with `prompt_lp` its PromptLogprobs first ([1, T])."""
    if lp is None:
        return [token]
    if prompt_lp:
        return with_prompt_logprobs(token, lp, 0, prompt_len)
    return with_logprobs(np.asarray([[token]]), lp, 1)[0]
