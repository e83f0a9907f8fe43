"""The SSD round loop (single-controller driver): target and draft programs on their own
devices, linked by two small transfers per round.

Round t, per row (L committed, r at L, speculation s = s_1..s_K ready on both sides):
  target side:  verify [r, s] -> (k, t*), commit K+1 K/V           (sd.verify_round)
  draft side:   glue/fork/tree over the same [r, s] -> cache C_t   (draft.build_cache)
  exchange 1:   (k, t*) target -> draft
  draft side:   advance the row, look up (k, t*) in C_t: hit -> cached branch, miss -> backup
  exchange 2:   next speculation (+ q', point-mass flags) draft -> target
With asynchronous dispatch the two sides' programs run concurrently on disjoint devices; the
host only enqueues work and reads emitted tokens a chunk of rounds later. The same jitted
programs serve the multi-controller driver (multihost.py), where the exchanges are collectives.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.backup import append_tokens
from ssd_jax.batch import Batch
from ssd_jax.config import SpecConfig
from ssd_jax.draft import build_cache, draft_vocab_size, empty_cache, select
from ssd_jax.fanout import FanoutModel
from ssd_jax.metrics import RunMetrics
from ssd_jax.models.transformer import KVCache, commit
from ssd_jax.runner import ModelRunner
from ssd_jax.sd import advance, spec_prefill, verify_round
from ssd_jax.speed import BackupChooser

advance_jit = jax.jit(advance)


def _mean_tokens(hist: np.ndarray) -> float | None:
    return float((hist * (np.arange(len(hist)) + 1)).sum() / hist.sum()) if hist.sum() else None


@partial(jax.jit, static_argnames=("seq_len",))
def _init_history(tokens, lengths, last, seq_len: int):
    """Each row's tokens so far (prompt + r) in a [B, seq_len] buffer for the n-gram backup;
    built inside one program on the draft's devices."""
    B, T = tokens.shape
    history = jnp.zeros((B, seq_len), jnp.int32).at[:, :T].set(tokens)
    return history.at[jnp.arange(B), lengths].set(last)


@jax.jit
def _record_emitted(history, lengths, out, n, frozen):
    """Append a round's emitted tokens (s_1..s_n, t*) at positions L+1.. of the history."""
    return append_tokens(history, lengths + 1, out, jnp.where(frozen, 0, n + 1))


@dataclass(frozen=True)
class Placement:
    """Where each side's arrays live; None = the default device (one-device runs)."""

    target: jax.sharding.Sharding | None = None
    draft: jax.sharding.Sharding | None = None

    def to_target(self, tree):
        return tree if self.target is None else jax.device_put(tree, self.target)

    def to_draft(self, tree):
        return tree if self.draft is None else jax.device_put(tree, self.draft)


@dataclass
class SSDStats:
    """Per-run SSD counters (host side)."""

    rounds: int = 0  # row-rounds of live rows
    hits: int = 0
    all_hit_rounds: int = 0
    batch_rounds: int = 0
    accept_hit: np.ndarray = None
    accept_miss: np.ndarray = None
    build_s: float = 0.0
    select_s: float = 0.0
    backup: str = "neural"  # the backup in use (backup="auto" re-decides every chunk)

    def record(self, n, hit, done, rows: int) -> np.ndarray:
        """Count one round of the real rows (the first `rows`); returns the live-row mask."""
        live = ~np.asarray(done)[:rows]
        n, hit = np.asarray(n)[:rows], np.asarray(hit)[:rows]
        self.rounds += int(live.sum())
        self.hits += int((hit & live).sum())
        if live.any():
            self.batch_rounds += 1
            self.all_hit_rounds += int(hit[live].all())
        np.add.at(self.accept_hit, n[live & hit], 1)
        np.add.at(self.accept_miss, n[live & ~hit], 1)
        return live

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.rounds, 1)

    @property
    def all_hit_rate(self) -> float:
        return self.all_hit_rounds / max(self.batch_rounds, 1)

    def to_dict(self) -> dict:
        return dict(hit_rate=self.hit_rate, all_hit_rate=self.all_hit_rate,
                    rounds=self.rounds, hits=self.hits,
                    accept_hist_hit=self.accept_hit.tolist(),
                    accept_hist_miss=self.accept_miss.tolist(),
                    build_s=self.build_s, select_s=self.select_s, backup=self.backup)


def ssd_loop(target: ModelRunner, draft: ModelRunner, vocab, batch: Batch,
             target_cache: KVCache, draft_cache: KVCache, spec: SpecConfig,
             metrics: RunMetrics, sync_every: int, placement: Placement = Placement(),
             backup: str = "neural") -> Iterator[list[list[int]]]:
    K, M = spec.k, spec.branches
    B = batch.size
    V = draft_vocab_size(vocab, target.config.vocab_size)
    fan_model = FanoutModel(spec.fanout, K, M)
    stats = SSDStats(accept_hit=np.zeros(K + 1, np.int64), accept_miss=np.zeros(K + 1, np.int64))
    metrics.ssd = stats
    sync = metrics.sync_phases
    greedy = batch.greedy_only
    fmax = min(M, V)
    c = jnp.float32(spec.c)

    t0 = time.perf_counter()
    state_t, target_cache, draft_cache = spec_prefill(target, draft, vocab, batch, target_cache,
                                                      draft_cache, placement.to_draft)
    first = np.asarray(state_t.last)
    metrics.ttft_s = time.perf_counter() - t0
    yield [[int(x)] for x in first[:batch.n]]

    # Draft-side copies of what the draft programs read.
    sampling_d, stop_d, max_new_d = placement.to_draft((batch.sampling, batch.stop_ids,
                                                        batch.max_new))
    state_d = placement.to_draft(state_t)
    S = target_cache.seq_len
    history = _init_history(placement.to_draft(batch.tokens), state_d.lengths, state_d.last, S)

    def lists():
        prim = np.tile(fan_model.primary(), (B, 1)).astype(np.int32)
        fast = np.tile(fan_model.after_fast_backup(), (B, 1)).astype(np.int32)
        return placement.to_draft((jnp.asarray(prim), jnp.asarray(fast)))

    chooser = BackupChooser() if backup == "auto" else None
    if chooser is not None:
        backup = chooser.choose(batch.n)
    stats.backup = backup
    primary, fast_list = lists()
    cache_d = placement.to_draft(empty_cache(B, M, K, None if greedy else V))
    none = placement.to_draft(jnp.full((B,), -1, jnp.int32))
    spec_d = select(draft.graphdef, draft.params, vocab, state_d, cache_d, none, none, history,
                    draft_cache, sampling_d, primary, c, backup, greedy, K, fmax)
    tokens_d, q_d, pm_d, hit_d, _ = spec_d
    tokens_t, q_t, pm_t = placement.to_target((tokens_d, q_d, pm_d))

    t1 = time.perf_counter()
    while True:
        rounds = []
        for _ in range(sync_every):
            ts = time.perf_counter()
            # Target step(t) and draft step(t) are enqueued back to back: on disjoint devices
            # they run at the same time.
            new_state_t, out_t, n_t, t_t, kv = verify_round(
                target.graphdef, target.params, state_t, tokens_t, q_t, pm_t, target_cache,
                batch.sampling, batch.stop_ids, batch.max_new, greedy)
            target_cache = commit(target_cache, kv, state_t.lengths)
            if sync:
                n_t.block_until_ready()
            tv = time.perf_counter()
            fan = jnp.where(pm_d[:, None], fast_list, primary)
            cache_d, glue_kv = build_cache(draft.graphdef, draft.params, vocab, state_d, tokens_d,
                                           draft_cache, sampling_d, fan, c, M, greedy)
            draft_cache = commit(draft_cache, glue_kv, state_d.lengths)
            if sync:
                cache_d.tokens.block_until_ready()
            tb = time.perf_counter()
            # Exchange 1, then select on the draft side, then exchange 2.
            n_d, t_d = placement.to_draft((n_t, t_t))
            new_state_d, out_d = advance_jit(state_d, tokens_d, n_d, t_d, stop_d, max_new_d)
            history = _record_emitted(history, state_d.lengths, out_d, n_d, state_d.done)
            was_hit = hit_d
            tokens_d, q_d, pm_d, hit_d, rank_d = select(
                draft.graphdef, draft.params, vocab, new_state_d, cache_d, n_d, t_d, history,
                draft_cache, sampling_d, primary, c, backup, greedy, K, fmax)
            tokens_t, q_t, pm_t = placement.to_target((tokens_d, q_d, pm_d))
            if sync:
                tokens_t.block_until_ready()
                te = time.perf_counter()
                metrics.verify_s += tv - ts
                stats.build_s += tb - tv
                stats.select_s += te - tb
            rounds.append((out_t, n_t, state_t.done, was_hit, rank_d))
            state_t, state_d = new_state_t, new_state_d

        # Host side, a chunk behind: emitted tokens, statistics, fan-out update.
        outs = np.stack([np.asarray(o)[:batch.n] for o, *_ in rounds], axis=1)
        for _, n, done, hit, rank in rounds:
            live = stats.record(n, hit, done, batch.n)
            fan_model.observe(np.asarray(n)[:batch.n][live], np.asarray(rank)[:batch.n][live])
        metrics.accept_hist = (stats.accept_hit + stats.accept_miss).tolist()
        metrics.decode_steps += len(rounds)
        metrics.decode_s = time.perf_counter() - t1
        if spec.fanout != "uniform":
            primary, fast_list = lists()
        if chooser is not None:  # re-decide with this run's constants (speed.py)
            t_v = metrics.verify_s / max(metrics.decode_steps, 1)
            chooser.observe(stats.hits, stats.rounds,
                            _mean_tokens(stats.accept_hit),
                            stats.build_s / metrics.decode_steps / t_v if sync and t_v else None)
            backup = stats.backup = chooser.choose(batch.n)
        yield [[int(x) for x in row.reshape(-1) if x >= 0] for row in outs]
        if np.asarray(state_t.done)[:batch.n].all():
            return
