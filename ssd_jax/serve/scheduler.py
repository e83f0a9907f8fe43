"""The decode thread of the server: a queue of requests, a `LiveBatch` of slots, and the text
each request streams back.

Between rounds it admits queued requests into free slots (a batch-of-1 prefill written into the
running batch), frees the slots of finished or abandoned requests, then runs one round for all
slots. Nobody waits for an unrelated request: a request that arrives while others decode joins
at the next round boundary. Tokens are cut exactly as offline `generate` cuts them (at the first
stop token, at max_tokens), text at the first stop string, even one spanning tokens.

Log-probabilities (a request's `logprobs`) come from the same rounds: a round in which any
running request wants them runs the target's programs that also return the top-`lp_width`
tokens at every emitted position (core/logprobs.py); other rounds cost nothing extra. Each
token's entry goes out with the text delta that completes the token's text, and whatever is
left (a stop token, the tail a stop string cut) with the last event, so a request gets one
entry per token of usage.completion_tokens.

An echoed prompt (completions' `echo`) goes out as the first delta, before the first token's,
with its log-probabilities when asked for: the joining row's prefill then scores every prompt
position (runner.prefill's prompt_logprobs), in the same program that draws the first token.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ssd_jax import stop_strings
from ssd_jax.serve.protocol import APIError, Job

log = logging.getLogger(__name__)


@dataclass(eq=False)  # identity: a request is kept in a set until its last event
class Request:
    """One request's life in the scheduler. `push(event)` delivers events to the HTTP side:
    ("delta", text, logprob entries), then ("done", finish_reason, completion tokens,
    speculation, logprob entries) or ("error", message). An entry (LogprobEntry) is one
    token's; requests without `logprobs` get empty lists."""

    job: Job
    push: object
    stop_ids: set
    arrived: float = field(default_factory=time.perf_counter)
    slot: int | None = None
    tokens: list = field(default_factory=list)
    sent: str = ""  # text already delivered (of the answer: an echoed prompt is apart)
    offset: int = 0  # where the answer's text starts in the response (after an echoed prompt)
    entries: list = field(default_factory=list)  # LogprobEntry per token, when asked for
    entries_sent: int = 0
    finish: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    rounds: int = 0
    accepted: int = 0
    hits: int = 0
    first_token_s: float | None = None
    done_s: float | None = None
    quiet: bool = False  # the server's own warm-up: not counted in /metrics

    def cancel(self) -> None:
        """The client went away: the slot is freed at the next round boundary."""
        self.cancelled.set()


class LogprobEntry(NamedTuple):
    """One emitted (or echoed prompt) token's log-probability, the top alternatives at its
    position as ((id, logprob), ...), and where its text starts in the response's text. An
    echoed prompt's first token has None for both: nothing predicts it."""

    token: int
    logprob: float | None
    top: tuple | None
    text_offset: int


class Scheduler:
    """`lp_width`: how many top tokens the target returns per position when a request asks
    for log-probabilities (requests may ask for at most that many)."""

    def __init__(self, live, text, mode: str, k: int, *, max_queue: int, metrics=None,
                 lp_width: int = 0):
        self.live, self.text, self.mode, self.k = live, text, mode, k
        self.lp_width = lp_width
        self.max_queue, self.metrics = max_queue, metrics
        self.pending: collections.deque[Request] = collections.deque()
        self.active: dict[int, Request] = {}
        self.open: set[Request] = set()  # submitted, not yet given their last event
        self.events: list[tuple[float, str, str, int]] = []  # (time, join/leave, job id, slot)
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ssd-jax-decode", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel whatever is queued or running (each gets its error event now), end the
        thread after the round in flight; `timeout=0`: do not wait for it (a signal handler)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
            # Their error goes out now, not after the round in flight: a round can take
            # seconds (a long prompt's prefill, a big model), and uvicorn cuts the connections
            # it is still waiting on after its graceful timeout.
            for req in list(self.open):
                self._end(req, ("error", "the server is shutting down: this request was "
                                         "stopped before it finished"))
        if timeout and self._thread.is_alive():
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, *reqs: Request) -> None:
        """Queue `reqs` (the choices of one response) all together, or none of them."""
        with self._cond:
            if self._stop or self.error is not None:
                raise APIError(503, "the server is shutting down or its decode loop failed",
                               kind="server_error")
            if len(self.pending) + len(reqs) > self.max_queue:
                raise APIError(429, f"the queue is full ({self.max_queue} requests wait for a "
                                    "slot): retry later", kind="rate_limit_error")
            self.pending.extend(reqs)
            self.open.update(reqs)
            self._gauge()
            self._cond.notify()

    # ---------------------------------------------------------------- the decode thread
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stop or self.pending or self.active):
                        self._cond.wait()
                    if self._stop:
                        break
                self._admit()
                self._drop_cancelled()
                if self.active:
                    self._round()
        except BaseException as e:  # a failed round fails every request, loudly
            log.exception("the decode loop failed")
            self.error = e
        for req in [*self.active.values(), *self.pending]:
            self._end(req, ("error", "the server stopped before this request finished"
                            if self.error is None else f"decode failed: {self.error}"))
        self.active.clear()
        self.pending.clear()

    def _admit(self) -> None:
        free = [i for i in self.live.free_slots() if i not in self.active]
        while free:
            with self._cond:
                if not self.pending:
                    break
                req = self.pending.popleft()
                self._gauge()
            if req.cancelled.is_set():
                self._end(req, None)
                continue
            slot = free.pop(0)
            job = req.job
            prompt_lp = job.echo and _wants(req)
            try:
                first, lp = self.live.join(slot, job.prompt_ids, job.params, sorted(req.stop_ids),
                                           self.lp_width if _wants(req) else None, prompt_lp)
            except ValueError as e:  # refused before it touched the batch (LiveBatch.request)
                log.warning("request %s refused at join: %s", req.job.id, e)
                self._end(req, ("error",
                                f"the request was refused: {str(e).splitlines()[0]}"))
                free.insert(0, slot)
                continue
            req.slot, req.first_token_s = slot, time.perf_counter()
            self.active[slot] = req
            self.events.append((time.perf_counter(), "join", req.job.id, slot))
            if self.metrics and not req.quiet:
                self.metrics.ttft.observe(req.first_token_s - req.arrived)
            if job.echo:
                self._echo(req, lp if prompt_lp else None)
            if job.prompt_only:
                self._finish(req, "length")
                continue
            self._take(req, [first], _row(lp, 0, [len(job.prompt_ids) - 1 if prompt_lp else 0]))
        self._gauge()

    def _echo(self, req: Request, lp) -> None:
        """The prompt's text as the request's first delta; given `lp` (the prefill's [1, T]
        log-probabilities), one entry per prompt token, the first with none (nothing predicts
        it)."""
        ids = req.job.prompt_ids
        text = self.text(ids)
        entries = []
        if lp is not None:
            entries = [LogprobEntry(ids[0], None, None, 0)] + [
                LogprobEntry(t, lp_t, top, len(self.text(ids[:i + 1])))
                for i, (t, (lp_t, top)) in enumerate(zip(ids[1:], _row(
                    lp, 0, list(range(len(ids) - 1)))))]
        req.offset = len(text)
        if req in self.open:
            req.push(("delta", text, entries))

    def _drop_cancelled(self) -> None:
        for slot, req in list(self.active.items()):
            if req.cancelled.is_set():
                self._finish(req, "cancelled")

    def _round(self) -> None:
        want = any(_wants(r) for r in self.active.values())
        out, done, hit, lp = self.live.step(self.lp_width if want else None)
        for slot, req in list(self.active.items()):
            at = [i for i, t in enumerate(out[slot]) if t >= 0]
            toks = [int(out[slot][i]) for i in at]
            if not toks:
                continue
            req.rounds += 1
            req.accepted += len(toks) - 1
            req.hits += int(hit is not None and hit[slot])
            if self.metrics and self.mode != "ar" and not req.quiet:
                self.metrics.accepted.observe(len(toks) - 1)
            self._take(req, toks, _row(lp, slot, at) if _wants(req) else None)
            if req.finish is None and done[slot]:  # cannot happen: done rows end in _take
                self._finish(req, "length")

    # ---------------------------------------------------------------- tokens -> text
    def _take(self, req: Request, toks: list[int], lps: list | None = None) -> None:
        """Append a round's tokens (and, with `lps`, each one's (logprob, top) pair), cut as
        offline generate cuts, stream the new text."""
        reason, before, stops = None, len(req.tokens), req.job.params.stop
        for i, t in enumerate(toks):
            if lps is not None:
                req.entries.append(LogprobEntry(t, *lps[i],
                                                req.offset + len(self.text(req.tokens))))
            req.tokens.append(t)
            if t in req.stop_ids:
                reason = "stop"
            elif len(req.tokens) >= req.job.params.max_new_tokens:
                reason = "length"
            if reason:
                break
        text = self.text(req.tokens)
        cut = stop_strings.cut(text, stops, req.job.params.include_stop_str_in_output)
        if cut is not None:
            # The answer ends with the token that completed the string, as offline.
            end = stop_strings.kept(req.tokens, before, self.text, stops)
            del req.tokens[end:], req.entries[end:]
            text, reason = cut, "stop"
        elif reason is None:
            # Hold back an incomplete character and a tail that may start a stop string.
            shown = stop_strings.shown(text, stops)
            text = shown if len(shown) > len(req.sent) else req.sent
        if len(text) > len(req.sent) and req in self.open:
            new, req.sent = text[len(req.sent):], text
            req.push(("delta", new, self._covered(req)))
        if reason:
            self._finish(req, reason)

    def _covered(self, req: Request) -> list:
        """The entries not yet sent of the tokens whose text has gone out in full."""
        j = req.entries_sent
        while j < len(req.entries) and len(self.text(req.tokens[:j + 1])) <= len(req.sent):
            j += 1
        out, req.entries_sent = req.entries[req.entries_sent:j], j
        return out

    def _finish(self, req: Request, reason: str) -> None:
        req.finish, req.done_s = reason, time.perf_counter()
        if req.slot is not None and self.active.get(req.slot) is req:
            self.live.leave(req.slot)
            del self.active[req.slot]
            self.events.append((time.perf_counter(), "leave", req.job.id, req.slot))
        if self.metrics and not req.quiet:
            self.metrics.finished(req, self.mode)
        rest, req.entries_sent = req.entries[req.entries_sent:], len(req.entries)
        self._end(req, None if reason == "cancelled" else
                  ("done", reason, len(req.tokens), self.speculation(req), rest))
        self._gauge()

    def _end(self, req: Request, event: tuple | None) -> None:
        """Give `req` its last event (None: nobody listens any more), once: the decode thread
        and a stop() from the signal handler may both try."""
        with self._cond:
            if req not in self.open:
                return
            self.open.discard(req)
        if event is not None:
            req.push(event)

    def speculation(self, req: Request) -> dict:
        rounds = max(req.rounds, 1)
        out = dict(mode=self.mode, rounds=req.rounds)
        if self.mode != "ar":
            out.update(drafted_tokens=req.rounds * self.k, accepted_tokens=req.accepted,
                       mean_accepted_length=req.accepted / rounds)
        if self.mode == "ssd":
            out.update(cache_hit_rate=req.hits / rounds, backup_rounds=req.rounds - req.hits)
        return out

    def _gauge(self) -> None:
        if self.metrics:
            self.metrics.queue.set(len(self.pending))
            self.metrics.running.set(len(self.active))


def _wants(req: Request) -> bool:
    return req.job.logprobs is not None


def _row(lp, slot: int, positions: list[int]) -> list | None:
    """One row's (logprob, ((id, logprob), ...)) at the emitted `positions` of a round."""
    if lp is None:
        return None
    return [(float(lp.chosen[slot, i]),
             tuple(zip(lp.top_ids[slot, i].tolist(), lp.top[slot, i].tolist())))
            for i in positions]
