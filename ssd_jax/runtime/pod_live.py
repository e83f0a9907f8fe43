"""A server's continuous batch on a pod: the lead's `LiveBatch` calls, mirrored by the other
processes of the groups.

The server (its HTTP side and scheduler) runs on the lead alone. Each call that runs programs
(join, leave, a round) is first published on a `pod.Stream`; every other process of the target
group, and in SSD of the draft group, reads the calls in order and makes the same call on its own
`LiveBatch` (the side it holds), so the target's programs run SPMD across the target group and
the two groups meet in each round's exchange, as in an offline pod run. Reads of results
(`free_slots`, the emitted tokens) stay on the lead.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Callable

from ssd_jax.config import SamplingParams
from ssd_jax.runtime.pod import Stream


def keep_for(slots: int) -> int:
    """Messages a stream keeps: more than the joins and leaves between two rounds."""
    return max(Stream.KEEP, 4 * slots)


class LeadLive:
    """The lead's live batch on a pod: the `LiveBatch` interface the scheduler uses, each call
    published before it runs. `failed(e)` ends the process on an error (the others wait in
    collectives this one will not join: pod.py's loud failure)."""

    def __init__(self, live, stream: Stream, failed: Callable[[BaseException], None]):
        self.live, self.stream, self._failed = live, stream, failed
        self.slots, self.mode, self.closed = live.slots, live.mode, False

    def free_slots(self) -> list[int]:
        return self.live.free_slots()

    def request(self, ids: list[int], params: SamplingParams, stops: list[int]):
        return self.live.request(ids, params, stops)  # host-side checks: nothing to mirror

    def join(self, slot: int, ids: list[int], params: SamplingParams, stops: list[int],
             logprobs: int | None = None, prompt_logprobs: bool = False):
        self.live.request(ids, params, stops)  # bad input raises here, before the others see it
        self.stream.publish(dict(op="join", slot=slot, ids=list(ids), params=asdict(params),
                                 stops=list(stops), logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs))
        return self._run(self.live.join, slot, ids, params, stops, logprobs, prompt_logprobs)

    def leave(self, slot: int) -> None:
        self.stream.publish(dict(op="leave", slot=slot))
        self._run(self.live.leave, slot)

    def step(self, logprobs: int | None = None):
        # The width is published: it picks the target's program, which every process of a
        # multi-process target group must run alike.
        self.stream.publish(dict(op="step", logprobs=logprobs))
        return self._run(self.live.step, logprobs)

    def close(self) -> None:
        """End the followers' mirror loops (they go back to waiting for the lead's requests)."""
        if not self.closed:
            self.closed = True
            self.stream.publish(dict(op="end"))

    def _run(self, call, *args):
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001 - failed() ends the process
            self._failed(e)


def mirror(live, stream: Stream) -> None:
    """A follower: make the lead's calls on this process's side of the live batch until the
    lead closes it."""
    while True:
        msg = stream.receive()
        op = msg["op"]
        if op == "end":
            return
        if op == "join":
            live.join(msg["slot"], msg["ids"], SamplingParams(**msg["params"]), msg["stops"],
                      msg.get("logprobs"), msg.get("prompt_logprobs", False))
        elif op == "leave":
            live.leave(msg["slot"])
        elif op == "step":
            live.step(msg.get("logprobs"))
        else:
            raise ValueError(f"unknown live-batch call {op!r} from the lead")
