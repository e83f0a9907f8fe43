"""Multi-controller SSD: the target and the draft run in different processes under
`jax.distributed` (TPU pods, multi-host GPU clusters, and two pinned processes on one CPU).

Each process dispatches only its own side's jitted programs (the same ones the single-controller
driver uses) and both call `Exchange.swap`, a jitted collective (shard_map + ppermute over the
union of the two sides' devices), at the same points of every round:
  target: verify(t) ............ swap#1 send (k, t*) ... swap#2 receive next speculation
  draft:  build_cache(t) ....... swap#1 receive (k, t*) -> advance, select -> swap#2 send
Both sides advance their copy of the batch state with the same function on the same inputs, so
they agree on lengths and on when every row is done without any other message.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ssd_jax.batch import Batch
from ssd_jax.config import SpecConfig
from ssd_jax.draft import build_cache, draft_vocab_size, empty_cache, select
from ssd_jax.fanout import FanoutModel
from ssd_jax.metrics import RunMetrics
from ssd_jax.models.transformer import KVCache, commit
from ssd_jax.runner import ModelRunner, _is_stop
from ssd_jax.sd import SpecState, draft_in, verify_round
from ssd_jax.speed import BackupChooser
from ssd_jax.ssd import SSDStats, _init_history, _mean_tokens, _record_emitted, advance_jit

TARGET, DRAFT = 0, 1


class Exchange:
    """Swap equal-shaped buffers between process 0 (target) and process 1 (draft).

    Each process may own several devices (a tensor-parallel target slice, a draft host): the
    swap runs between the two processes' first devices, and what arrives is put, explicitly,
    on `local` (this side's replicated sharding) so this side's programs can read it.
    A round trip costs one small collective (~1.3 ms on localhost with gloo, measured); the
    device arrays never pass through the host on GPU/TPU interconnects.
    """

    def __init__(self, local: jax.sharding.Sharding | None = None):
        if jax.process_count() != 2:
            raise RuntimeError(f"the multi-controller exchange needs 2 processes (target, draft), "
                               f"found {jax.process_count()}")
        leads = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                 for p in range(2)]
        self.mesh = Mesh(np.array(leads), ("p",))
        self.lead = leads[jax.process_index()]
        self.local = local
        self.sharding = NamedSharding(self.mesh, P("p"))

        @jax.jit
        @partial(jax.shard_map, mesh=self.mesh, in_specs=P("p"), out_specs=P("p"))
        def swap(x):
            return jax.lax.ppermute(x, "p", perm=[(0, 1), (1, 0)])

        self._swap = swap

    def place(self, tree):
        """This side's arrays (created on its default device) onto its devices."""
        return tree if self.local is None else jax.device_put(tree, self.local)

    def swap(self, x: jax.Array) -> jax.Array:
        x = jax.device_put(jnp.asarray(x).reshape(1, -1), self.lead)
        g = jax.make_array_from_single_device_arrays((2, x.shape[1]), self.sharding, [x])
        return self.place(self._swap(g).addressable_shards[0].data[0])


def _pack_outcome(n, t):
    return jnp.concatenate([n.astype(jnp.int32), t.astype(jnp.int32)])


def _unpack_outcome(buf, B):
    return buf[:B], buf[B:]


def _pack_spec(tokens, point_mass, hit):
    return jnp.concatenate([tokens.reshape(-1), point_mass.astype(jnp.int32),
                            hit.astype(jnp.int32)])


def _unpack_spec(buf, B, K):
    return (buf[:B * K].reshape(B, K), buf[B * K:B * K + B].astype(bool),
            buf[B * K + B:].astype(bool))


def target_loop(target: ModelRunner, batch: Batch, cache: KVCache, spec: SpecConfig,
                metrics: RunMetrics, sync_every: int, ex: Exchange, vocab_size: int
                ) -> Iterator[list[list[int]]]:
    """The target process: prefill, then verify rounds fed by the draft process."""
    K, B, greedy = spec.k, batch.size, batch.greedy_only
    stats = SSDStats(accept_hit=np.zeros(K + 1, np.int64), accept_miss=np.zeros(K + 1, np.int64))
    metrics.ssd = stats
    t0 = time.perf_counter()
    ar, cache = target.prefill(batch.tokens, batch.prompt_len, cache, batch.sampling,
                               batch.stop_ids, batch.max_new)
    prev = jnp.take_along_axis(batch.tokens, (batch.prompt_len - 1)[:, None], 1)[:, 0]
    state = SpecState(prev, ar.tokens, ar.lengths, ar.generated, ar.done)
    first = np.asarray(state.last)
    metrics.ttft_s = time.perf_counter() - t0
    yield [[int(x)] for x in first[:batch.n]]

    spec_zeros = ex.place(jnp.zeros((B * K + 2 * B,), jnp.int32))
    q_zeros = None if greedy else ex.place(jnp.zeros((B * K * vocab_size,), jnp.float32))

    def receive():
        tokens, pm, hit = _unpack_spec(ex.swap(spec_zeros), B, K)
        q = None if greedy else ex.swap(q_zeros).reshape(B, K, vocab_size)
        return tokens, q, pm, hit

    ex.swap(_pack_outcome(ex.place(jnp.full((B,), -1, jnp.int32)), state.last))
    tokens, q, pm, hit = receive()
    exposed = 0.0
    t1 = time.perf_counter()
    while not np.asarray(state.done)[:batch.n].all():
        rounds = []
        for _ in range(sync_every):
            ts = time.perf_counter()
            new_state, out, n, t, kv = verify_round(
                target.graphdef, target.params, state, tokens, q, pm, cache, batch.sampling,
                batch.stop_ids, batch.max_new, greedy)
            cache = commit(cache, kv, state.lengths)
            n.block_until_ready()  # cheap on CPU; separates verify from the draft's exposure
            tv = time.perf_counter()
            ex.swap(_pack_outcome(n, t))
            was_hit = hit
            tokens, q, pm, hit = receive()
            tokens.block_until_ready()
            te = time.perf_counter()
            metrics.verify_s += tv - ts
            exposed += te - tv
            rounds.append((out, n, state.done, was_hit))
            state = new_state
        outs = np.stack([np.asarray(o)[:batch.n] for o, *_ in rounds], axis=1)
        for _, n, done, was_hit in rounds:
            stats.record(n, was_hit, done, batch.n)
        metrics.accept_hist = (stats.accept_hit + stats.accept_miss).tolist()
        metrics.decode_steps += len(rounds)
        metrics.decode_s = time.perf_counter() - t1
        stats.select_s = exposed  # target-side wait for the next speculation (exposed draft)
        yield [[int(x) for x in row.reshape(-1) if x >= 0] for row in outs]


def draft_loop(draft: ModelRunner, vocab, batch: Batch, cache: KVCache, spec: SpecConfig,
               sync_every: int, ex: Exchange, vocab_size: int, backup: str = "neural") -> dict:
    """The draft process: mirrors target_loop's exchanges round for round."""
    K, M, B, greedy = spec.k, spec.branches, batch.size, batch.greedy_only
    vocab_size = draft_vocab_size(vocab, vocab_size)
    fmax = min(M, vocab_size)
    c = jnp.float32(spec.c)
    fan_model = FanoutModel(spec.fanout, K, M)
    cache = draft.fill(draft_in(vocab, batch.tokens), cache)
    zeros = ex.place(jnp.zeros((2 * B,), jnp.int32))
    _, r = _unpack_outcome(ex.swap(zeros), B)
    prev = jnp.take_along_axis(batch.tokens, (batch.prompt_len - 1)[:, None], 1)[:, 0]
    # The same first-token bookkeeping as the target's prefill (runner.prefill).
    # (ones computed from prompt_len, so they live on this side's devices, not on device 0)
    state = SpecState(prev, r, batch.prompt_len, batch.prompt_len * 0 + 1,
                      _is_stop(r, batch.stop_ids) | (batch.max_new <= 1))
    history = _init_history(batch.tokens, state.lengths, r, cache.seq_len)

    def lists():
        prim = np.tile(fan_model.primary(), (B, 1)).astype(np.int32)
        fast = np.tile(fan_model.after_fast_backup(), (B, 1)).astype(np.int32)
        return ex.place((jnp.asarray(prim), jnp.asarray(fast)))

    def send(tokens, q, pm, hit):
        ex.swap(_pack_spec(tokens, pm, hit))
        if not greedy:
            ex.swap(q.reshape(-1).astype(jnp.float32))

    chooser = BackupChooser() if backup == "auto" else None
    if chooser is not None:
        backup = chooser.choose(batch.n)
    hits = rounds_seen = 0
    tokens_on_hit = np.zeros(K + 1)
    primary, fast_list = lists()
    spec_cache = ex.place(empty_cache(B, M, K, None if greedy else vocab_size))
    none = ex.place(jnp.full((B,), -1, jnp.int32))
    tokens, q, pm, hit, _ = select(draft.graphdef, draft.params, vocab, state, spec_cache, none,
                                   none, history, cache, batch.sampling, primary, c, backup,
                                   greedy, K, fmax)
    send(tokens, q, pm, hit)
    was_hit = hit
    build_s = 0.0
    while not np.asarray(state.done)[:batch.n].all():
        rounds = []
        for _ in range(sync_every):
            tb = time.perf_counter()
            fan = jnp.where(pm[:, None], fast_list, primary)
            spec_cache, glue_kv = build_cache(draft.graphdef, draft.params, vocab, state, tokens,
                                              cache, batch.sampling, fan, c, M, greedy)
            cache = commit(cache, glue_kv, state.lengths)
            spec_cache.tokens.block_until_ready()
            build_s += time.perf_counter() - tb
            n, t = _unpack_outcome(ex.swap(zeros), B)
            new_state, out = advance_jit(state, tokens, n, t, batch.stop_ids, batch.max_new)
            history = _record_emitted(history, state.lengths, out, n, state.done)
            tokens, q, pm, hit, rank = select(
                draft.graphdef, draft.params, vocab, new_state, spec_cache, n, t, history, cache,
                batch.sampling, primary, c, backup, greedy, K, fmax)
            rounds.append((n, rank, state.done, was_hit))
            was_hit = hit
            send(tokens, q, pm, hit)
            state = new_state
        for n, rank, done, h in rounds:
            live = ~np.asarray(done)[:batch.n]
            n, h = np.asarray(n)[:batch.n][live], np.asarray(h)[:batch.n][live]
            fan_model.observe(n, np.asarray(rank)[:batch.n][live])
            hits, rounds_seen = hits + int(h.sum()), rounds_seen + int(live.sum())
            np.add.at(tokens_on_hit, n[h], 1)
        if spec.fanout != "uniform":
            primary, fast_list = lists()
        if chooser is not None:
            chooser.observe(hits, rounds_seen, _mean_tokens(tokens_on_hit))
            backup = chooser.choose(batch.n)
    return {"build_s": build_s, "fanout": fan_model.primary().tolist(), "a": fan_model.a,
            "r": fan_model.r, "backup": backup}
