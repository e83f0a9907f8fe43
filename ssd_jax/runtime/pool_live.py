"""A continuous batch in the worker processes (runtime/pool.py): offline `generate` past
max_batch with the "processes" driver (SSD on CPU).

Each worker holds its side of one `core.live.LiveBatch` (AR and SD: the target worker holds
both models; SSD: the target worker the target, the draft worker the draft, meeting in each
round's exchange). This object is the `LiveBatch` interface continuous.py drives; each call
is sent to the workers of the mode in one order and the target worker answers it with its
result and the free slots after it, so reading the slots costs no message of its own.
"""
from __future__ import annotations

from dataclasses import asdict

from ssd_jax.config import SamplingParams, SpecConfig
from ssd_jax.core.live import joining_row


class WorkerLive:
    def __init__(self, pool, mode: str, slots: int, spec: SpecConfig, *, seq_len: int,
                 prefill_bucket: int, greedy_only: bool = False, penalties: bool = True):
        self.pool, self.mode = pool, mode
        self.bucket, self.greedy_only, self.penalties = prefill_bucket, greedy_only, penalties
        self.roles = ("target", "draft") if mode == "ssd" else ("target",)
        self.closed = False
        self._free: list[int] = []
        self.slots = self._call(dict(op="open", mode=mode, slots=slots, spec=asdict(spec),
                                     seq_len=seq_len, prefill_bucket=prefill_bucket,
                                     greedy_only=greedy_only, penalties=penalties))

    def free_slots(self) -> list[int]:
        return list(self._free)

    def request(self, ids: list[int], params: SamplingParams, stops: list[int]):
        """The joining row's checks, here: bad input raises before the workers see it."""
        return joining_row(ids, params, stops, self.bucket, self.greedy_only, self.penalties)

    def join(self, slot: int, ids: list[int], params: SamplingParams, stops: list[int],
             logprobs: int | None = None, prompt_logprobs: bool = False):
        self.request(ids, params, stops)
        return self._call(dict(op="join", slot=slot, ids=list(ids), params=asdict(params),
                               stops=list(stops), logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs))

    def leave(self, slot: int) -> None:
        self._call(dict(op="leave", slot=slot))

    def step(self, logprobs: int | None = None):
        return self._call(dict(op="step", logprobs=logprobs))

    def close(self) -> None:
        """Drop the workers' sides (their caches); the pool serves other requests after."""
        if not self.closed:
            self.closed = True
            self.pool.live_end(self.roles)

    def _call(self, msg: dict):
        if self.closed:
            raise RuntimeError("this live batch is closed")
        out, self._free = self.pool.live_call(self.roles, msg)
        return out
