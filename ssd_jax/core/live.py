"""Continuous batching at round boundaries: a batch of B slots whose rows join and leave between
rounds, for a server. The rounds are the offline loops' own steps (rounds.ssd_round, the target
step, SD's drafting, the AR step); what this adds is the bookkeeping of slots.

A request joins a free slot by a batch-of-1 prefill (target, and the draft's prefill and first
speculation in SSD) whose state pytrees are written into row `slot` of the running batch's
(`put_row`): every state here has the batch as its leading axis. A row leaves by being marked
done on every side, which freezes it exactly as a finished row is frozen; its slot is then free.
Rows never see each other (attention, sampling keys and verification are per row), so a
request's tokens do not depend on what else runs: greedy output equals offline `generate`.

A server's batch is built with greedy_only=False, so one set of programs serves greedy and
sampled requests alike (greedy rows take exact argmaxes inside them), with penalties=True (the
target's rows always carry token counts, so a request with penalties joins the same programs),
and with STOP_WIDTH stop ids per row, so every join writes rows of one shape. Offline
`generate` (continuous.py), knowing all its rows, may take the greedy-only programs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.config import SamplingParams
from ssd_jax.core.batch import Batch, make_batch
from ssd_jax.core.draft import DraftConfig
from ssd_jax.core.logprobs import HostLogprobs, TokenLogprobs
from ssd_jax.core.rounds import DraftSide, RoundState, TargetSide, ssd_round
from ssd_jax.core.speculation import Outcome, sd_speculation
from ssd_jax.core.transport import LocalLink


OBSERVE_EVERY = 8
STOP_WIDTH = 16  # stop ids per request: one width, so every join writes the same shape
# logit_bias entries per request, likewise (a power of two: make_batch's widths are, so a
# batch wider than this holds a request with more entries)
BIAS_WIDTH = 64


def _pad(x, width: int, value, what: str):
    if x.shape[1] > width:
        raise ValueError(f"more than {width} {what}: at most {width} per request")
    return jnp.concatenate([x, jnp.full((x.shape[0], width - x.shape[1]), value, x.dtype)],
                           axis=1)


def _live(b: Batch, greedy_only: bool = False, penalties: bool = True) -> Batch:
    """A batch as the live batch holds it: its programs' flags (by default sampled ones with
    token counts, which serve any request), stop ids padded to STOP_WIDTH and logit biases to
    BIAS_WIDTH."""
    s = b.req.sampling
    sampling = s._replace(bias_ids=_pad(s.bias_ids, BIAS_WIDTH, 0, "logit_bias entries"),
                          bias=_pad(s.bias, BIAS_WIDTH, 0.0, "logit_bias entries"))
    return replace(b, greedy_only=greedy_only, penalties=penalties, req=b.req._replace(
        stop_ids=_pad(b.req.stop_ids, STOP_WIDTH, -1, "stop token ids"), sampling=sampling))


def _put(big, small, slot):
    """Row 0 of every leaf of `small` written into row `slot` of the same leaf of `big`."""
    return jax.tree.map(lambda b, s: jax.lax.dynamic_update_slice_in_dim(b, s, slot, axis=0),
                        big, small)


# Small state is copied: with one device per side the link hands the same buffers to both
# sides (the speculation), so donating them would delete the other side's copy. The KV caches
# are each side's own and large: updated in place.
put_row = jax.jit(_put)
put_cache = jax.jit(_put, donate_argnums=0)


def _put_state(big, small, slot):
    """A TargetState or DraftState row: the cache in place, the rest copied (fan-out lists
    are the batch's, not the row's)."""
    fields = {name: (put_cache if name == "cache" else put_row)(getattr(big, name),
                                                                 getattr(small, name), slot)
              for name in big._fields if name != "fan"}
    return big._replace(**fields)


@jax.jit
def _mark_done(rows, slot):
    return rows._replace(done=rows.done.at[slot].set(True))


@runtime_checkable
class Live(Protocol):
    """What drives a live batch (continuous.py, the server's scheduler) calls: a LiveBatch in
    this process, or one across processes (runtime/pool_live.py, runtime/pod_live.py)."""
    slots: int
    mode: str

    def free_slots(self) -> list[int]: ...

    def request(self, ids: list[int], params: SamplingParams, stops: list[int]) -> Batch: ...

    def join(self, slot: int, ids: list[int], params: SamplingParams, stops: list[int],
             logprobs: int | None = None, prompt_logprobs: bool = False): ...

    def leave(self, slot: int) -> None: ...

    def step(self, logprobs: int | None = None): ...

    def close(self) -> None: ...


class LiveBatch:
    """B slots decoding `mode` ("ar", "sd" or "ssd"); `step()` runs one round and returns each
    slot's emitted tokens. `spec` is a resolved config.SpecConfig.

    `side`: None when this process holds both sides. In a pod (runtime/pod.py) each process
    holds one, "target" or "draft", and builds this object with the runner of that side only;
    `link` and `join_link` are then the groups' CollectiveLinks for the batch and for one
    joining row, and every process of both groups makes the same calls in the same order
    (runtime/pod_live.py mirrors the lead's).

    `greedy_only` / `penalties`: the programs' flags (Batch's). A server cannot know its
    requests ahead and keeps the defaults, which serve any; offline `generate` knows its rows
    and takes the cheaper programs where they allow (greedy rows only; no penalties)."""

    def __init__(self, mode: str, target_runner, draft_runner, vocab, *, slots: int,
                 seq_len: int, prefill_bucket: int, spec=None, link=LocalLink(),
                 side: str | None = None, join_link=None, shardings=None,
                 greedy_only: bool = False, penalties: bool = True):
        self.mode, self.seq_len, self.bucket, self.link = mode, seq_len, prefill_bucket, link
        self.greedy_only, self.penalties = greedy_only, penalties
        self.join_link = join_link or link
        self.spec, self.vocab, self.draft_runner = spec, vocab, draft_runner
        self.on_target, self.on_draft = shardings or (link.target, link.draft)
        # The idle batch: every row a one-token request, done after prefill (all slots free).
        idle = self._batch([[0]] * slots, [SamplingParams(max_new_tokens=1, seed=0)] * slots)
        slots = idle.size  # batches are padded to a power of two: every row is a slot
        self.target = self.draft = None
        ts = ds = spec_t = None
        if side in (None, "target"):
            self.target = TargetSide(target_runner, idle.place(self.on_target),
                                     target_runner.new_cache(slots, seq_len))
            ts, _ = self.target.prefill()
        if mode == "ssd":
            if side in (None, "draft"):
                self.draft = DraftSide.create(draft_runner, vocab, idle.place(self.on_draft),
                                              spec, seq_len, link.to_draft)
            ds, spec_t = _start(self.draft, ts, link)
        elif mode == "sd":
            self.draft_cache = draft_runner.new_cache(slots, seq_len)
            self.sd_cfg = DraftConfig(draft_runner.graphdef, vocab, spec.k, budget=0,
                                      greedy_only=greedy_only)
        self.state = RoundState(ts, ds, spec_t)
        self.slots = slots
        self._records: list = []  # SSD: draft-side outcomes since the fan-out's last refit
        self._joining: tuple | None = None  # SSD: (slot, first speculation) not handed over

    def _batch(self, ids, params) -> Batch:
        return _live(make_batch(ids, params, [[]] * len(ids), self.bucket), self.greedy_only,
                     self.penalties)

    # ---------------------------------------------------------------- slots
    def free_slots(self) -> list[int]:
        """The target side's free slots (the side that owns requests)."""
        return [int(i) for i in np.flatnonzero(np.asarray(self.state.target.rows.done))]

    def join(self, slot: int, ids: list[int], params: SamplingParams, stops: list[int],
             logprobs: int | None = None, prompt_logprobs: bool = False
             ) -> tuple[int, HostLogprobs | None] | None:
        """Prefill one request into `slot`; returns its first token and, given `logprobs` (a
        top-N width), its log-probabilities (row 0 of a batch of one: [1, 1], or with
        `prompt_logprobs` [1, T] over the prompt then the first token, runner.prefill); None on
        a draft-only process.

        SSD: the draft's prefill and the row's first speculation run on the draft's devices
        after the first token is known, and the speculation is handed to the target at this
        object's next call, not here: the first token streams while the draft works (on a
        pod the draft is another process), and the next join's target prefill overlaps it."""
        b = self.request(ids, params, stops)
        ts1 = lp = None
        if self.target is not None:
            runner = self.target.runner
            one = TargetSide(runner, b.place(self.on_target), runner.new_cache(1, self.seq_len))
            ts1, lp = one.prefill(logprobs, prompt_logprobs)
            self.target.batch = replace(self.target.batch, req=put_row(
                self.target.batch.req, one.batch.req, slot))
            self.state.target = _put_state(self.state.target, ts1, slot)
        if self.mode == "ssd":
            self._hand_over()  # the previous join's, first: both sides call in one order
            d, one_draft = self.draft, None
            if d is not None:
                one_draft = replace(d, batch=b.place(self.on_draft),
                                    cache=d.runner.new_cache(1, self.seq_len))
            ds1, spec1 = _draft_start(one_draft, ts1, self.join_link)
            if d is not None:
                d.batch = replace(d.batch, req=put_row(d.batch.req, one_draft.batch.req, slot))
                self.state.draft = _put_state(self.state.draft, ds1, slot)
            self._joining = (slot, spec1)
        elif self.mode == "sd":
            d = self.draft_runner
            one_cache = d.fill(self.vocab.draft_ids(b.tokens), d.new_cache(1, self.seq_len))
            self.draft_cache = put_cache(self.draft_cache, one_cache, slot)
        return None if ts1 is None else (int(np.asarray(ts1.rows.last)[0]), _host(lp))

    def _hand_over(self) -> None:
        """The last joined row's first speculation, from the draft side to the target's copy
        (a cross-process receive on a pod's target, a send on its draft)."""
        if self._joining is None:
            return
        slot, spec1 = self._joining
        self._joining = None
        spec1 = self.join_link.speculation(spec1)
        if spec1 is not None:
            self.state.spec = put_row(self.state.spec, spec1, slot)

    def request(self, ids: list[int], params: SamplingParams, stops: list[int]) -> Batch:
        """One request as a joining row; raises ValueError for what it cannot hold."""
        return joining_row(ids, params, stops, self.bucket, self.greedy_only, self.penalties)

    def leave(self, slot: int) -> None:
        """Free `slot` (finished, cancelled or disconnected): the row is frozen on every side."""
        self._hand_over()
        s = self.state
        ts = None if s.target is None else s.target._replace(
            rows=_mark_done(s.target.rows, slot))
        ds = None if s.draft is None else s.draft._replace(rows=_mark_done(s.draft.rows, slot))
        self.state = RoundState(ts, ds, s.spec)

    def close(self) -> None:
        """Nothing to end in one process (its arrays go with the object); a live batch across
        processes (runtime/pool_live.py, runtime/pod_live.py) ends the others' side."""

    # ---------------------------------------------------------------- rounds
    def step(self, logprobs: int | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, HostLogprobs | None] | None:
        """One round (an AR step, an SD or an SSD round) over every slot. Returns the emitted
        tokens [B, K+1] (-1 padded; rows that were free emit nothing), the done flags, in
        SSD whether each row's verified speculation was a cache hit, and given `logprobs` (a
        top-N width; None costs nothing) the emitted tokens' log-probabilities. A draft-only
        process returns None."""
        self._hand_over()
        s, hit = self.state, None
        if self.mode == "ssd":
            s, t_rec, d_rec = ssd_round(self.target, self.draft, self.link, s, logprobs=logprobs)
            if self.draft is not None:
                # The fan-out (and an automatic backup) learn from the outcomes, as offline:
                # refit every OBSERVE_EVERY rounds, not every round (new lists are a
                # host->device copy).
                self._records.append(d_rec)
                if len(self._records) == OBSERVE_EVERY:
                    s.draft = self.draft.observe(self._records, s.draft, None)
                    self._records = []
            self.state = s
            if t_rec is None:
                return None
            out, hit, lp = t_rec[0], np.asarray(t_rec[3]), t_rec[4]
        elif self.mode == "sd":
            spec, self.draft_cache = sd_speculation(self.draft_runner, self.sd_cfg,
                                                    s.target.rows, self.draft_cache,
                                                    self.target.batch.req)
            ts, _, out, lp = self.target.verify(s.target, spec, logprobs)
            self.state = RoundState(ts, None, None)
        else:
            before = s.target.rows
            rows, cache, lp = self.target.runner.decode(before, s.target.cache,
                                                        self.target.batch.req, logprobs)
            out = jnp.where(before.done, -1, rows.last)[:, None]
            self.state = RoundState(s.target._replace(rows=rows, cache=cache), None, None)
        return np.asarray(out), np.asarray(self.state.target.rows.done), hit, _host(lp)


def joining_row(ids: list[int], params: SamplingParams, stops: list[int], bucket: int,
                greedy_only: bool, penalties: bool) -> Batch:
    """One request as a row joining a live batch of these flags; raises ValueError for what
    such a batch cannot hold (the check a process without the batch can make too)."""
    return _live(make_batch([ids], [params], [stops], bucket), greedy_only, penalties)


def _host(lp: TokenLogprobs | None) -> HostLogprobs | None:
    return None if lp is None else HostLogprobs(*(np.asarray(a) for a in lp))


def _start(draft: DraftSide | None, ts, link) -> tuple:
    """The draft side's prefill and first speculation from the target's first tokens, across
    `link` (a pod process passes None for the side it does not hold, as ssd_loop does).
    Returns (the draft's state, the target's copy of the speculation), None where absent."""
    ds, spec = _draft_start(draft, ts, link)
    return ds, link.speculation(spec)


def _draft_start(draft: DraftSide | None, ts, link) -> tuple:
    """_start without the hand-over: (the draft's state, its speculation), None where absent."""
    first = link.outcome(None if ts is None else Outcome(ts.rows.last * 0 - 1, ts.rows.last))
    return draft.start(first.t) if draft is not None else (None, None)
