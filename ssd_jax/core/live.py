"""Continuous batching at round boundaries: a batch of B slots whose rows join and leave between
rounds, for a server. The rounds are the offline loops' own steps (rounds.ssd_round, the target
step, SD's drafting, the AR step); what this adds is the bookkeeping of slots.

A request joins a free slot by a batch-of-1 prefill (target, and the draft's prefill and first
speculation in SSD) whose state pytrees are written into row `slot` of the running batch's
(`put_row`): every state here has the batch as its leading axis. A row leaves by being marked
done on every side, which freezes it exactly as a finished row is frozen; its slot is then free.
Rows never see each other (attention, sampling keys and verification are per row), so a
request's tokens do not depend on what else runs: greedy output equals offline `generate`.

The batch is built with greedy_only=False, so one set of programs serves greedy and sampled
requests alike (greedy rows take exact argmaxes inside them), and with STOP_WIDTH stop ids per
row, so every join writes rows of one shape.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.config import SamplingParams
from ssd_jax.core.batch import Batch, make_batch
from ssd_jax.core.draft import DraftConfig
from ssd_jax.core.rounds import DraftSide, RoundState, TargetSide, ssd_round
from ssd_jax.core.speculation import sd_speculation
from ssd_jax.core.transport import LocalLink


OBSERVE_EVERY = 8
STOP_WIDTH = 16  # stop ids per request: one width, so every join writes the same shape


def _live(b: Batch) -> Batch:
    """A batch as the live batch holds it: sampled programs, stop ids padded to STOP_WIDTH."""
    stops = b.req.stop_ids
    if stops.shape[1] > STOP_WIDTH:
        raise ValueError(f"{stops.shape[1]} stop token ids: at most {STOP_WIDTH} per request")
    pad = jnp.full((stops.shape[0], STOP_WIDTH - stops.shape[1]), -1, stops.dtype)
    return replace(b, greedy_only=False,
                   req=b.req._replace(stop_ids=jnp.concatenate([stops, pad], axis=1)))


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


class LiveBatch:
    """B slots decoding `mode` ("ar", "sd" or "ssd") in this process; `step()` runs one round
    and returns each slot's emitted tokens. `spec` is a resolved config.SpecConfig."""

    def __init__(self, mode: str, target_runner, draft_runner, vocab, *, slots: int,
                 seq_len: int, prefill_bucket: int, spec=None, link: LocalLink = LocalLink()):
        self.mode, self.seq_len, self.bucket, self.link = mode, seq_len, prefill_bucket, link
        self.spec, self.vocab, self.draft_runner = spec, vocab, draft_runner
        # The idle batch: every row a one-token request, done after prefill (all slots free).
        idle = self._batch([[0]] * slots, [SamplingParams(max_new_tokens=1, seed=0)] * slots)
        slots = idle.size  # batches are padded to a power of two: every row is a slot
        self.target = TargetSide(target_runner, idle.place(link.target),
                                 target_runner.new_cache(slots, seq_len))
        ts = self.target.prefill()
        self.draft, ds, spec_t, self.draft_cache = None, None, None, None
        if mode == "ssd":
            self.draft = DraftSide.create(draft_runner, vocab, idle.place(link.draft), spec,
                                          seq_len, link.to_draft)
            ds, spec_d = self.draft.start(link.to_draft(ts.rows.last))
            spec_t = link.speculation(spec_d)
        elif mode == "sd":
            self.draft_cache = draft_runner.new_cache(slots, seq_len)
            self.sd_cfg = DraftConfig(draft_runner.graphdef, vocab, spec.k, budget=0,
                                      greedy_only=False)
        self.state = RoundState(ts, ds, spec_t)
        self.slots = slots
        self._records: list = []  # SSD: draft-side outcomes since the fan-out's last refit

    def _batch(self, ids, params) -> Batch:
        return _live(make_batch(ids, params, [[]] * len(ids), self.bucket))

    # ---------------------------------------------------------------- slots
    def free_slots(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(np.asarray(self.state.target.rows.done))]

    def join(self, slot: int, ids: list[int], params: SamplingParams, stops: list[int]) -> int:
        """Prefill one request into `slot`; returns its first token."""
        b = _live(make_batch([ids], [params], [stops], self.bucket))
        link, s = self.link, self.state
        one = TargetSide(self.target.runner, b.place(link.target),
                         self.target.runner.new_cache(1, self.seq_len))
        ts1 = one.prefill()
        self.target.batch = replace(self.target.batch, req=put_row(
            self.target.batch.req, one.batch.req, slot))
        ts, ds, spec_t = _put_state(s.target, ts1, slot), s.draft, s.spec
        if self.mode == "ssd":
            d = self.draft
            bd = b.place(link.draft)
            one_draft = replace(d, batch=bd, cache=d.runner.new_cache(1, self.seq_len))
            ds1, spec1 = one_draft.start(link.to_draft(ts1.rows.last))
            d.batch = replace(d.batch, req=put_row(d.batch.req, bd.req, slot))
            ds = _put_state(s.draft, ds1, slot)
            spec_t = put_row(s.spec, link.speculation(spec1), slot)
        elif self.mode == "sd":
            d = self.draft_runner
            one_cache = d.fill(self.vocab.draft_ids(b.tokens), d.new_cache(1, self.seq_len))
            self.draft_cache = put_cache(self.draft_cache, one_cache, slot)
        self.state = RoundState(ts, ds, spec_t)
        return int(np.asarray(ts1.rows.last)[0])

    def leave(self, slot: int) -> None:
        """Free `slot` (finished, cancelled or disconnected): the row is frozen on every side."""
        s = self.state
        ts = s.target._replace(rows=_mark_done(s.target.rows, slot))
        ds = None if s.draft is None else s.draft._replace(rows=_mark_done(s.draft.rows, slot))
        self.state = RoundState(ts, ds, s.spec)

    # ---------------------------------------------------------------- rounds
    def step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """One round (an AR step, an SD or an SSD round) over every slot. Returns the emitted
        tokens [B, K+1] (-1 padded; rows that were free emit nothing), the done flags and, in
        SSD, whether each row's verified speculation was a cache hit."""
        s, req, hit = self.state, self.target.batch.req, None
        if self.mode == "ssd":
            s, t_rec, d_rec = ssd_round(self.target, self.draft, self.link, s)
            out, hit = t_rec[0], np.asarray(t_rec[3])
            # The fan-out (and an automatic backup) learn from the outcomes, as offline: refit
            # every OBSERVE_EVERY rounds, not every round (new lists are a host->device copy).
            self._records.append(d_rec)
            if len(self._records) == OBSERVE_EVERY:
                s.draft = self.draft.observe(self._records, s.draft, None)
                self._records = []
        elif self.mode == "sd":
            spec, self.draft_cache = sd_speculation(self.draft_runner, self.sd_cfg,
                                                    s.target.rows, self.draft_cache, req)
            ts, _, out = self.target.verify(s.target, spec)
            s = RoundState(ts, None, None)
        else:
            before = s.target.rows
            rows, cache = self.target.runner.decode(before, s.target.cache, req)
            out = jnp.where(before.done, -1, rows.last)[:, None]
            s = RoundState(s.target._replace(rows=rows, cache=cache), None, None)
        self.state = s
        return np.asarray(out), np.asarray(s.target.rows.done), hit
