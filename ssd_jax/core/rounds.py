"""The decode loops: AR, SD and SSD, each a thin loop over the core's step functions.

One SSD round (`ssd_round`), per row with L committed, r at L and speculation s = s_1..s_K
held by both sides:
  target side:  verify [r, s] -> outcome (n, t*), commit K+1 K/V           (target.py)
  draft side:   glue/fork/tree over the same [r, s] -> speculation cache   (draft.build)
  transport:    outcome, target -> draft                                    (transport.py)
  draft side:   advance the rows, look (n, t*) up: hit -> cached branch, miss -> backup
  transport:    next speculation, draft -> target
The same function runs in both drivers. In one process (`LocalLink`) both sides are present and,
with asynchronous dispatch, their programs run at the same time on disjoint devices: the host
only enqueues work and reads emitted tokens a chunk of rounds later. In the worker-process
driver (`CollectiveLink`) each process holds one side and passes None for the other.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.core.backups import BACKUPS
from ssd_jax.core.batch import Batch
from ssd_jax.core.draft import DraftConfig, DraftState, FanLists, build, select, start
from ssd_jax.core.fanout import FanoutModel
from ssd_jax.core.logprobs import TokenLogprobs, with_logprobs
from ssd_jax.core.metrics import RunMetrics, SSDStats
from ssd_jax.core.runner import ModelRunner
from ssd_jax.core.speculation import Outcome, Speculation, sd_speculation
from ssd_jax.core.speed import BackupChooser
from ssd_jax.core.target import TargetState, target_step
from ssd_jax.models.transformer import KVCache

# Per real row, the tokens emitted in a chunk of rounds; when the batch asked for
# log-probabilities (Batch.logprobs), (token, logprob, {id: logprob}) triples instead, and in
# the first chunk of a batch that asked for its prompts' (Batch.prompt_logprobs) each row's
# PromptLogprobs ahead of its first token.
Chunk = list[list[int]] | list[list[tuple]]


class PromptLogprobs(NamedTuple):
    """One row's prompt log-probabilities: per prompt token after the first, (its logprob,
    {id: logprob} of the top-N there). Not a token: readers that count tokens skip it."""

    entries: list


def _emit(outs: list, rows: int, lps: list | None = None) -> Chunk:
    """A chunk's emitted tokens [B, *] per round -> each real row's tokens (-1 padding cut),
    with their log-probabilities where `lps` (one TokenLogprobs per round) is given."""
    if lps is not None:
        per_round = [with_logprobs(np.asarray(o).reshape(np.shape(o)[0], -1), lp, rows)
                     for o, lp in zip(outs, lps)]
        return [sum((r[b] for r in per_round), []) for b in range(rows)]
    stacked = np.concatenate([np.asarray(o)[:rows].reshape(rows, -1) for o in outs], axis=1)
    return [[int(x) for x in row if x >= 0] for row in stacked]


def _first(ts: TargetState, lp, b: Batch) -> Chunk:
    """The prefill's chunk: each real row's first token (with its log-probabilities, and
    with Batch.prompt_logprobs its PromptLogprobs first: the prefill's lp is then [B, T],
    position t scoring prompt token t + 1 and prompt_len - 1 the first token)."""
    if not b.prompt_logprobs:
        return _emit([ts.rows.last[:, None]], b.n, None if lp is None else [lp])
    first, lens = np.asarray(ts.rows.last), np.asarray(b.prompt_len).tolist()
    lp = tuple(np.asarray(a) for a in lp)
    return [with_prompt_logprobs(int(first[r]), lp, r, lens[r]) for r in range(b.n)]


def with_prompt_logprobs(first: int, lp, r: int, prompt_len: int) -> list:
    """Row r's first chunk entries from a prefill that scored its prompt (lp: host arrays
    chosen [B, T], top_ids and top [B, T, N]; position t scores prompt token t + 1 and
    prompt_len - 1 the first token): its PromptLogprobs, then (first, logprob, top)."""
    chosen, top_ids, top = lp

    def at(t: int) -> tuple[float, dict]:
        return float(chosen[r, t]), dict(zip(top_ids[r, t].tolist(), top[r, t].tolist()))
    return [PromptLogprobs([at(t) for t in range(prompt_len - 1)]),
            (first, *at(prompt_len - 1))]


def tokens_in(chunk: Chunk) -> int:
    """How many tokens a chunk holds (its PromptLogprobs are not tokens)."""
    return sum(not isinstance(t, PromptLogprobs) for row in chunk for t in row)


def _all_done(rows, n: int) -> bool:
    return bool(np.asarray(rows.done)[:n].all())


@dataclass
class TargetSide:
    """The target's part of a run: its programs, the batch and an empty cache on its devices."""

    runner: ModelRunner
    batch: Batch
    cache: KVCache

    def prefill(self, logprobs: int | None = None, prompt_logprobs: bool = False
                ) -> tuple[TargetState, TokenLogprobs | None]:
        """The batch's prompts in; given `logprobs` (a top-N width), also the first tokens'
        log-probabilities (core/logprobs.py), and with `prompt_logprobs` the prompts' too
        (runner.prefill)."""
        b = self.batch
        rows, cache, lp = self.runner.prefill(b.tokens, b.prompt_len, self.cache, b.req, logprobs,
                                              prompt_logprobs, b.penalties)
        return TargetState(rows, cache), lp

    def verify(self, state: TargetState, spec: Speculation, logprobs: int | None = None):
        return target_step(self.runner, state, spec, self.batch.req, self.batch.greedy_only,
                           logprobs)


@dataclass
class DraftSide:
    """SSD's draft part of a run: programs, the batch and an empty cache on the draft's devices,
    and the host-side policies updated between chunks (fan-out fit, backup choice)."""

    runner: ModelRunner
    cfg: DraftConfig
    batch: Batch
    cache: KVCache
    place: Callable  # host-made arrays -> the draft's devices (the link's to_draft)
    fanout: FanoutModel
    auto_backup: bool = False
    chooser: BackupChooser = field(default_factory=BackupChooser)
    stats: SSDStats = None

    @classmethod
    def create(cls, runner: ModelRunner, vocab, batch: Batch, spec, seq_len: int,
               place: Callable) -> "DraftSide":
        """The draft side of a run with settings `spec` (a resolved config.SpecConfig)."""
        backup = spec.backup_or_default
        cfg = DraftConfig(runner.graphdef, vocab, spec.k, spec.branches, batch.greedy_only,
                          spec.c or 1.0, BACKUPS["neural" if backup == "auto" else backup],
                          penalties=batch.penalties)
        return cls(runner, cfg, batch, runner.new_cache(batch.size, seq_len), place,
                   FanoutModel(spec.fanout, spec.k, spec.branches), auto_backup=backup == "auto")

    def __post_init__(self):
        self.stats = SSDStats(k=self.cfg.k, backup=self.cfg.backup.name)
        if self.auto_backup:
            self._set_backup(self.chooser.choose(self.batch.n))

    def _set_backup(self, name: str) -> None:
        self.cfg = DraftConfig(**{**self.cfg.__dict__, "backup": BACKUPS[name]})
        self.stats.backup = name

    def lists(self) -> FanLists:
        B = self.batch.size
        return self.place(FanLists(
            jnp.asarray(np.tile(self.fanout.primary(), (B, 1)).astype(np.int32)),
            jnp.asarray(np.tile(self.fanout.after_fast_backup(), (B, 1)).astype(np.int32))))

    def start(self, first) -> tuple[DraftState, Speculation]:
        return start(self.runner, self.cfg, self.batch, first, self.cache, self.lists())

    def build(self, ds: DraftState):
        return build(self.runner, self.cfg, ds, self.batch.req)

    def select(self, ds: DraftState, tree, outcome):
        return select(self.cfg, self.runner.leaves, ds, tree, outcome, self.batch.req)

    def observe(self, records: list, ds: DraftState, t_verify: float | None) -> DraftState:
        """Between chunks: fit the fan-out to the chunk's outcomes, re-choose the backup."""
        n_real = self.batch.n
        for n, rank, done, hit in records:
            live = self.stats.record(n, hit, done, n_real)
            self.fanout.observe(np.asarray(n)[:n_real][live], np.asarray(rank)[:n_real][live])
        self.stats.fanout, self.stats.a, self.stats.r = (self.fanout.primary().tolist(),
                                                        self.fanout.a, self.fanout.r)
        if self.fanout.strategy != "uniform":
            # Placed as the old lists are (committed to their sharding or not): with one device
            # `place` leaves host-made arrays uncommitted, and where the old ones were committed
            # that is a new input signature: build_cache and select compiled again inside the
            # run a warm-up had prepared (SmolLM2, single driver: 0.8 tok/s timed).
            ds = ds._replace(fan=jax.tree.map(
                lambda new, old: jax.device_put(new, old.sharding) if old.committed else new,
                self.lists(), ds.fan))
        if self.auto_backup:  # re-decide with this run's constants (speed.py)
            rounds = max(sum(self.stats.accept_hist_hit) + sum(self.stats.accept_hist_miss), 1)
            t_p = self.stats.build_s / rounds / t_verify if t_verify else None
            self.chooser.observe(self.stats.hits, self.stats.rounds, self.stats.tokens_after_hit,
                                 t_p)
            self._set_backup(self.chooser.choose(n_real))
        return ds


@dataclass
class RoundState:
    """Between rounds: each present side's state, and the target's copy of the speculation."""

    target: TargetState | None
    draft: DraftState | None
    spec: Speculation | None


def ssd_round(target: TargetSide | None, draft: DraftSide | None, link, s: RoundState,
              phases: dict | None = None, logprobs: int | None = None
              ) -> tuple[RoundState, tuple | None, tuple | None]:
    """One SSD round (module docstring). Returns the new state and what each present side
    records: target (emitted tokens, n, done before, hit, their log-probabilities or None),
    draft (n, rank, done before, hit). `phases`: when given, block at each phase boundary and
    add its seconds there. `logprobs`: the target's top-N width, None for none."""
    t0 = time.perf_counter()
    outcome = t_rec = d_rec = None
    if target is not None:
        ts, outcome, out, lp = target.verify(s.target, s.spec, logprobs)
        t_rec = (out, outcome.n, s.target.rows.done, s.spec.hit, lp)
        if phases is not None:
            outcome.n.block_until_ready()
    t1 = time.perf_counter()
    if draft is not None:  # on other devices: runs while the target verifies
        tree, ds = draft.build(s.draft)
        if phases is not None:
            tree.tokens.block_until_ready()
    t2 = time.perf_counter()
    outcome = link.outcome(outcome)
    if draft is not None:
        if phases is not None and target is not None:
            # One process, timed: the outcome is here once verification is; separate the
            # phases. (A draft process does not block: select is queued behind the exchange,
            # and waiting on the host would add a dispatch to the critical path. Its select
            # time then includes waiting for the outcome.)
            outcome.n.block_until_ready()
        t3 = time.perf_counter()
        was = ds.rows.done, ds.spec.hit
        ds, spec, rank = draft.select(ds, tree, outcome)
        d_rec = (outcome.n, rank, was[0], was[1])
    spec = link.speculation(spec if draft is not None else None)
    if phases is not None:
        (spec if target is not None else ds.spec).tokens.block_until_ready()
        t4 = time.perf_counter()
        if target is not None:
            phases["verify_s"] += t1 - t0
            phases["exposed_s"] += t4 - t1
            # The wait split by what arrived: all hits, or some row's backup (done rows count
            # as hits: their speculation is discarded).
            kind = "hit" if bool(np.all(np.asarray(spec.hit | ts.rows.done))) else "miss"
            phases[f"exposed_{kind}"][0] += t4 - t1
            phases[f"exposed_{kind}"][1] += 1
            phases["verify_rounds"].append(t1 - t0)
        if draft is not None:
            phases["build_s"] += t2 - t1
            phases["select_s"] += t4 - t3
            phases["build_rounds"].append(t2 - t1)
    return (RoundState(ts if target else None, ds if draft else None, spec if target else None),
            t_rec, d_rec)


def ssd_loop(target: TargetSide | None, draft: DraftSide | None, link, metrics: RunMetrics,
             sync_every: int, timed: bool) -> Iterator[Chunk]:
    """Prefill, then SSD rounds a chunk at a time. The target side yields each chunk's tokens
    (the first chunk: the prefill's token); a draft-only process yields nothing. timed: block
    at phase boundaries to time them (RunMetrics.verify_s, SSDStats' phase times)."""
    stats = metrics.ssd = SSDStats(k=metrics.k)
    n_real = (target or draft).batch.n
    t0 = time.perf_counter()
    logprobs = target.batch.logprobs if target is not None else None
    ts, lp = (target.prefill(logprobs, target.batch.prompt_logprobs) if target is not None
              else (None, None))
    outcome = link.outcome(None if ts is None else Outcome(ts.rows.last * 0 - 1, ts.rows.last))
    ds, spec = draft.start(outcome.t) if draft is not None else (None, None)
    s = RoundState(ts, ds, link.speculation(spec))
    if target is not None:
        first = _first(ts, lp, target.batch)  # TTFT includes the first token's transfer
        metrics.ttft_s = time.perf_counter() - t0
        yield first
    phases = (dict(verify_s=0.0, exposed_s=0.0, build_s=0.0, select_s=0.0, verify_rounds=[],
                   build_rounds=[], exposed_hit=[0.0, 0], exposed_miss=[0.0, 0])
              if timed else None)
    t1 = time.perf_counter()
    while not _all_done((s.target or s.draft).rows, n_real):
        t_recs, d_recs = [], []
        for _ in range(sync_every):
            s, t_rec, d_rec = ssd_round(target, draft, link, s, phases, logprobs)
            t_recs.append(t_rec)
            d_recs.append(d_rec)
        # Host side, a chunk behind the devices: statistics, fan-out, emitted tokens.
        metrics.decode_steps += sync_every
        if phases is not None:
            metrics.verify_s, stats.exposed_s = phases["verify_s"], phases["exposed_s"]
            stats.exposed_hit_s, stats.exposed_hit_rounds = phases["exposed_hit"]
            stats.exposed_miss_s, stats.exposed_miss_rounds = phases["exposed_miss"]
            metrics.verify_rounds = phases["verify_rounds"]
            if draft is not None:
                draft.stats.build_s, draft.stats.select_s = phases["build_s"], phases["select_s"]
                draft.stats.build_rounds = phases["build_rounds"]
        if draft is not None:
            t_verify = (metrics.verify_s / metrics.decode_steps
                        if phases is not None and target is not None else None)
            s.draft = draft.observe(d_recs, s.draft, t_verify)
            stats.take_draft_side(draft.stats)
        if target is not None:
            for _, n, done, hit, _ in t_recs:
                stats.record(n, hit, done, n_real)
            metrics.accept_hist = [h + m for h, m in zip(stats.accept_hist_hit,
                                                           stats.accept_hist_miss)]
            chunk = _emit([r[0] for r in t_recs], n_real,
                          None if logprobs is None else [r[4] for r in t_recs])
            metrics.decode_s = time.perf_counter() - t1
            yield chunk


def sd_loop(target: TargetSide, draft: ModelRunner, vocab, draft_cache: KVCache,
            metrics: RunMetrics, sync_every: int) -> Iterator[Chunk]:
    """Ordinary speculative decoding on the target's devices: the draft proposes K tokens
    (speculation.sd_speculation), the target verifies them (the SSD round's target step)."""
    b, timed = target.batch, metrics.sync_phases
    cfg = DraftConfig(draft.graphdef, vocab, metrics.k, budget=0, greedy_only=b.greedy_only)
    k = cfg.k
    t0 = time.perf_counter()
    state, lp = target.prefill(b.logprobs, b.prompt_logprobs)
    draft_cache = draft.fill(vocab.draft_ids(b.tokens), draft_cache)
    first = _first(state, lp, b)
    metrics.ttft_s = time.perf_counter() - t0
    yield first
    hist = np.zeros(k + 1, np.int64)
    t1 = time.perf_counter()
    while not _all_done(state.rows, b.n):
        outs = []
        for _ in range(sync_every):
            ts = time.perf_counter()
            spec, draft_cache = sd_speculation(draft, cfg, state.rows, draft_cache, b.req)
            if timed:
                spec.tokens.block_until_ready()
            tv = time.perf_counter()
            was_done = state.rows.done
            state, outcome, out, lp = target.verify(state, spec, b.logprobs)
            if timed:
                outcome.n.block_until_ready()
                t_end = time.perf_counter()
                metrics.draft_s += tv - ts
                metrics.verify_s += t_end - tv
                metrics.draft_rounds.append(tv - ts)
                metrics.verify_rounds.append(t_end - tv)
            outs.append((out, outcome.n, was_done, lp))
        for _, n, was_done, _ in outs:
            live = ~np.asarray(was_done)[:b.n]
            np.add.at(hist, np.asarray(n)[:b.n][live], 1)
        metrics.decode_steps += len(outs)
        metrics.accept_hist = hist.tolist()
        chunk = _emit([o[0] for o in outs], b.n,
                      None if b.logprobs is None else [o[3] for o in outs])
        metrics.decode_s = time.perf_counter() - t1
        yield chunk


def ar_loop(target: TargetSide, metrics: RunMetrics, sync_every: int) -> Iterator[Chunk]:
    """One target forward per token. Rows past their stop repeat their last token, which the
    caller cuts off; the host reads a chunk of steps at a time, never waiting inside one."""
    b = target.batch
    t0 = time.perf_counter()
    state, lp = target.prefill(b.logprobs, b.prompt_logprobs)
    rows, cache = state.rows, state.cache
    first = _first(state, lp, b)  # TTFT includes the first token's transfer to the host
    metrics.ttft_s = time.perf_counter() - t0
    yield first
    steps, done_steps = b.max_steps - 1, 0
    t1 = time.perf_counter()
    while done_steps < steps and not _all_done(rows, b.n):
        chunk, lps, t_chunk = [], [], time.perf_counter()
        for _ in range(min(sync_every, steps - done_steps)):
            rows, cache, lp = target.runner.decode(rows, cache, b.req, b.logprobs)
            chunk.append(rows.last[:, None])
            lps.append(lp)
        done_steps += len(chunk)
        metrics.decode_steps += len(chunk)
        out = _emit(chunk, b.n, None if b.logprobs is None else lps)
        now = time.perf_counter()
        metrics.decode_s = now - t1
        metrics.step_chunks.append((now - t_chunk) / len(chunk))
        yield out
