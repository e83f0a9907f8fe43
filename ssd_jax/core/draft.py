"""SSD's draft side: while the target verifies [r, s_1..s_K] at positions L..L+K, the draft
pre-speculates the next round for the likeliest outcomes (build), then, told the outcome, hands
over the matching speculation or a backup's (select).

build:
  glue:  scores the same K+1 tokens -> g_0..g_K, g_j = the draft's next-token distribution after
         r, s_1..s_j (its K/V is committed to the draft cache: the accepted part is needed).
         When the speculation came out of the draft (a hit, or the neural backup) its own
         decoding already gave g_0..g_{K-1} and the K/V of r..s_{K-1} (glue.py): the glue then
         feeds s_K alone;
  fork:  at glue position j takes the top-F_j tokens x, excluding s_{j+1} for j < K (a rejected
         token is never the recovery token: at T=0 it differs from argmax p, at T>0 the
         residual max(0, p - q') is zero there). Branch (j, x) is the outcome "j accepted, the
         target emitted x"; F_j comes from the fan-out (fanout.py);
  tree:  decodes K tokens for all M branches at once. Branch (j, x) sits at positions L+j+1..
         and sees the committed prefix (< L), glue tokens 0..j and its own tokens, never its
         siblings. Glue and branch K/V stay in the attention's new-token block (`extra`), so the
         cache is only read inside this program and nothing speculative is ever written to it.
select: advance the rows by the outcome (the same `advance` as the target's), look (n, t) up in
  the cache: a hit hands over the cached branch, a miss the backup's (backups.py).
Every speculated token is drawn from q' = Saguaro-rescaled process_probs(draft logits) and q'
is kept, because verification must use the exact distribution a token came from.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ssd_jax.core.backups import NeuralBackup, append_tokens
from ssd_jax.core.glue import (GluePrefix, fork_candidates, greedy_with_candidates,
                               no_prefix, pick)
from ssd_jax.core.graph import Graph
from ssd_jax.core.rows import Requests, RowState, advance, prompt_seen, start_rows
from ssd_jax.core.speculation import Outcome, Saguaro, Speculation, propose, steer
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, commit


@dataclass(frozen=True)
class DraftConfig:
    """The draft side's static settings (hashable: a static argument of its programs)."""

    graphdef: Graph  # the draft model's nnx graph (hashed once)
    vocab: object  # draft_vocab.VocabMap or SameVocab
    k: int  # lookahead
    budget: int  # branches per row M
    greedy_only: bool
    c: float = 1.0  # Saguaro's C
    backup: object = NeuralBackup()  # backups.NeuralBackup() | FastBackup()
    # Some row may set a penalty (Batch.penalties): the draft's rows carry the token counts
    # and its proposals and fork candidates follow the penalised target (speculation.steer).
    penalties: bool = False

    @property
    def fmax(self) -> int:
        """The most fork candidates any glue position can take."""
        return min(self.budget, self.vocab.draft_size)


class FanLists(NamedTuple):
    """F_0..F_K per row (fanout.py), updated between chunks of rounds: `primary` for rows whose
    speculation came from the draft, `after_fast` for rows holding fast-backup guesses."""

    primary: Int[Array, "B K1"]
    after_fast: Int[Array, "B K1"]


class DraftState(NamedTuple):
    """The draft side between rounds. `spec` is the speculation the target is verifying."""

    rows: RowState  # advanced with the same function as the target's copy
    cache: KVCache  # valid through the glue of the last built round
    history: Int[Array, "B S"]  # each row's tokens so far, for the n-gram backup
    spec: Speculation  # with q over the draft vocabulary
    fan: FanLists
    glue: GluePrefix | None = None  # what spec's own decoding knows of its glue (glue.py)


class SpecCache(NamedTuple):
    """Speculations for every pre-speculated outcome of the round being verified.

    branch_j [B, M]: accept length the branch assumes (-1: empty slot, never hit);
    fork_tok [B, M]: the recovery/bonus token it assumes; tokens [B, M, K]: its speculation;
    q [B, M, K, Vd]: the distributions they were drawn from, over the draft's vocabulary (None
    when all greedy); cand [B, K+1, F]: glue candidates by rank (hit-rate-vs-F statistics);
    step_kv (per layer [B, K*M, Hkv, D], step-major) and step_cand [B, M, K, F]: each branch's
    K/V and fork candidates along its own tokens, the next glue's prefix if it hits (glue.py).
    """

    branch_j: Int[Array, "B M"]
    fork_tok: Int[Array, "B M"]
    tokens: Int[Array, "B M K"]
    q: Float[Array, "B M K Vd"] | None
    cand: Int[Array, "B K1 F"]
    step_kv: KVCache | None = None
    step_cand: Int[Array, "B M K F"] | None = None


def empty_cache(cfg: DraftConfig, batch: int) -> SpecCache:
    """The cache before the first round: no branch can hit."""
    B, M, K = batch, cfg.budget, cfg.k
    q = None if cfg.greedy_only else jnp.zeros((B, M, K, cfg.vocab.draft_size), jnp.float32)
    return SpecCache(jnp.full((B, M), -1, jnp.int32), jnp.full((B, M), -1, jnp.int32),
                     jnp.zeros((B, M, K), jnp.int32), q, jnp.full((B, K + 1, 1), -1, jnp.int32))


def branch_layout(fan: Int[Array, "B K1"], m: int) -> tuple[Int[Array, "B M"], Int[Array, "B M"]]:
    """Branch slot -> (glue position j, rank among that position's candidates)."""
    ends = jnp.cumsum(fan, axis=-1)  # [B, K+1]
    slot = jnp.arange(m)
    j = jnp.sum(ends[:, None, :] <= slot[None, :, None], axis=-1)  # [B, M]
    j = jnp.minimum(j, fan.shape[1] - 1)
    start = jnp.take_along_axis(ends - fan, j, axis=1)
    return j.astype(jnp.int32), (slot[None, :] - start).astype(jnp.int32)


def tree_mask(branch_j: Int[Array, "B M"], k: int, step: int) -> Bool[Array, "B M U"]:
    """Step `step` (0-based) of the tree decode: keys are glue (K+1) then the branch tokens of
    steps 0..step, M per step. A branch sees glue 0..j and its own column only."""
    B, M = branch_j.shape
    glue = jnp.arange(k + 1)[None, None, :] <= branch_j[:, :, None]
    own = jnp.tile(jnp.eye(M, dtype=bool), (1, step + 1))
    return jnp.concatenate([glue, jnp.broadcast_to(own, (B, M, M * (step + 1)))], axis=-1)


@partial(jax.jit, static_argnames=("cfg",))
def build_cache(cfg: DraftConfig, params, ds: DraftState, req: Requests
                ) -> tuple[SpecCache, KVCache]:
    """Glue decode + fork + tree decode over the speculation being verified. Returns the
    speculation cache and the glue K/V (committed at rows.lengths by `build`)."""
    model, vocab = cfg.graphdef.merge(params), cfg.vocab
    spec, L = ds.spec.tokens, ds.rows.lengths
    B, K = spec.shape
    M, fmax = cfg.budget, cfg.fmax
    fan = jnp.where(ds.spec.point_mass[:, None], ds.fan.after_fast, ds.fan.primary)
    seen = ds.rows.seen

    def one_hot(tokens):  # target ids [B, *S] -> counts [B, *S, Vd] in the draft's columns
        return jax.nn.one_hot(vocab.out_ids(tokens), vocab.draft_size, dtype=jnp.int32)

    def glue_counts():
        """[B, K+1, Vd]: the token counts at glue position j, the committed tokens (r
        included) and s_1..s_j, as the target counts them there."""
        cum = jnp.cumsum(one_hot(spec), axis=1)
        return (vocab.draft_columns(seen.counts)[:, None]
                + jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum], axis=1))

    def steered(logits, number, counts):
        """The target's law at these positions (speculation.steer): `number` [B, S], the answer
        token each would emit; the penalties' counts where the rows carry them."""
        return steer(logits, req, vocab, number, None if seen is None else counts,
                     None if seen is None else vocab.draft_columns(seen.in_prompt))

    # Glue position j (r, s_1..s_K) predicts answer token generated + 1 + j.
    glue_number = ds.rows.generated[:, None] + 1 + jnp.arange(K + 1)

    def full_glue(_):
        # Fork candidates: exclude s_{j+1} at j < K, rank the rest by the draft's logits.
        tokens = jnp.concatenate([ds.rows.last[:, None], spec], axis=1)
        logits, kv = model(vocab.draft_ids(tokens), L[:, None] + jnp.arange(K + 1), ds.cache, L,
                           causal_mask(B, K + 1))
        logits = steered(logits, glue_number, glue_counts)
        return (jnp.concatenate([fork_candidates(vocab, logits[:, :K], spec, fmax),
                                 fork_candidates(vocab, logits[:, K:], None, fmax)], axis=1), kv)

    def known_glue(_):
        # r..s_{K-1} were fed when spec was decoded (glue.py): only s_K is new.
        pre = ds.glue
        logits, kv = model(vocab.draft_ids(spec[:, K - 1:]), (L + K)[:, None], ds.cache, L,
                           jnp.ones((B, 1, K + 1), bool), extra=pre.kv)
        logits = steered(logits, glue_number[:, K:], lambda: glue_counts()[:, K:])
        kv = jax.tree.map(lambda a, b: jnp.concatenate([a.astype(b.dtype), b], axis=1),
                          pre.kv, kv)
        return (jnp.concatenate([pre.cand, fork_candidates(vocab, logits, None, fmax)], axis=1),
                kv)

    if ds.glue is None:
        cand, glue_kv = full_glue(None)  # [B, K+1, F], K+1 positions
    else:  # one program for the batch: the short glue only when every live row allows it
        cand, glue_kv = jax.lax.cond(jnp.all(ds.glue.ok | ds.rows.done), known_glue, full_glue,
                                     None)
    branch_j, rank = branch_layout(fan, M)
    fork_tok = jnp.take_along_axis(cand.reshape(B, -1), branch_j * fmax + rank, axis=1)

    # Tree decode: K steps for all M branches; glue and earlier branch K/V ride in `extra`.
    x, pos, extra = fork_tok, L[:, None] + branch_j + 1, glue_kv
    toks, qs, step_cand = [], [], []
    saguaro = Saguaro(fan, cfg.c, fmax)
    for step in range(K):
        logits, kv = model(vocab.draft_ids(x), pos, ds.cache, L, tree_mask(branch_j, K, step),
                           extra=extra)

        def branch_counts(step=step, toks=tuple(toks)):  # [B, M, Vd]: the branch's own path
            path = jnp.stack([fork_tok, *toks], axis=2)
            at_fork = jnp.take_along_axis(glue_counts(), jnp.maximum(branch_j, 0)[..., None],
                                          axis=1)
            return at_fork + one_hot(path).sum(axis=2)
        # A branch forked at j holds answer token generated + 1 + j; step s predicts the
        # token 1 + s after it.
        logits = steered(logits, glue_number[:, :1] + branch_j + 1 + step, branch_counts)
        if cfg.greedy_only:  # the argmax and the candidates after it: one top-k
            x, cand_s = greedy_with_candidates(vocab, logits, fmax)
            q = None
        else:
            x, q = propose(logits, req, pos + 1, vocab, False, (fan[:, step], saguaro))
            cand_s = fork_candidates(vocab, logits, x, fmax)
        toks.append(x)
        qs.append(q)
        step_cand.append(cand_s)  # [B, M, F]
        extra = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), extra, kv)
        pos = pos + 1
    q = None if cfg.greedy_only else jnp.stack(qs, axis=2)
    step_kv = jax.tree.map(lambda a: a[:, K + 1:], extra)  # the branches' own K/V
    return SpecCache(branch_j, fork_tok, jnp.stack(toks, axis=2), q, cand, step_kv,
                     jnp.stack(step_cand, axis=2)), glue_kv


def build(draft, cfg: DraftConfig, ds: DraftState, req: Requests
          ) -> tuple[SpecCache, DraftState]:
    """The draft's work during a verification, with `draft` a ModelRunner."""
    tree, glue_kv = build_cache(cfg, draft.leaves, ds, req)
    return tree, ds._replace(cache=commit(ds.cache, glue_kv, ds.rows.lengths))


def _lookup(cfg: DraftConfig, tree: SpecCache, outcome: Outcome):
    n, t = outcome
    match = (tree.branch_j == n[:, None]) & (tree.fork_tok == t[:, None]) & (tree.branch_j >= 0)
    m = jnp.argmax(match, axis=1)
    tokens = jnp.take_along_axis(tree.tokens, m[:, None, None], axis=1)[:, 0]
    q = None if cfg.greedy_only else jnp.take_along_axis(tree.q, m[:, None, None, None],
                                                         axis=1)[:, 0]
    # The rank of t among the glue candidates at n (fmax when absent): the fan-out's fit.
    cand_n = jnp.take_along_axis(tree.cand, jnp.clip(n, 0)[:, None, None], axis=1)[:, 0]
    found = cand_n == t[:, None]
    rank = jnp.where(jnp.any(found, 1), jnp.argmax(found, 1), cfg.fmax)
    hit = jnp.any(match, axis=1)
    prefix = None
    if tree.step_kv is not None:  # branch m's K/V sit at s*M + m of step s
        M, K = tree.branch_j.shape[1], cfg.k
        at = (jnp.arange(K)[None, :] * M + m[:, None])[:, :, None, None]  # [B, K, 1, 1]
        kv = jax.tree.map(lambda a: jnp.take_along_axis(a, at, axis=1), tree.step_kv)
        cand = jnp.take_along_axis(tree.step_cand, m[:, None, None, None], axis=1)[:, 0]
        prefix = GluePrefix(kv, cand, hit)
    return hit, tokens, q, rank, prefix


@partial(jax.jit, static_argnames=("cfg",))
def select(cfg: DraftConfig, params, ds: DraftState, tree: SpecCache | None,
           outcome: Outcome | None, req: Requests
           ) -> tuple[DraftState, Speculation, Int[Array, " B"]]:
    """The next speculation per row: the cached branch for outcome (n, t) on a hit, else the
    backup's. tree=None: the first speculation after prefill (the rows are already at r).
    Returns the new state (its spec, q over the draft vocabulary), the speculation for the
    target (q over the target vocabulary) and each row's rank (see _lookup)."""
    rows, history = ds.rows, ds.history
    if tree is None:
        tree = empty_cache(cfg, rows.last.shape[0])
        outcome = Outcome(jnp.full_like(rows.last, -1), rows.last)
    else:
        rows, out = advance(ds.rows, ds.spec.tokens, outcome.n, outcome.t, req)
        # The emitted tokens s_1..s_n, t* land at positions L+1.. of the history.
        history = append_tokens(history, ds.rows.lengths + 1, out,
                                jnp.where(ds.rows.done, 0, outcome.n + 1))
    ds = ds._replace(rows=rows, history=history)
    hit, hit_tokens, hit_q, rank, hit_prefix = _lookup(cfg, tree, outcome)
    model = cfg.graphdef.merge(params)
    b_tokens, b_q, point_mass, b_prefix = cfg.backup.propose(model, cfg, ds, req, hit)
    tokens = jnp.where(hit[:, None], hit_tokens, b_tokens)
    q = None if cfg.greedy_only else jnp.where(hit[:, None, None], hit_q, b_q)
    spec = Speculation(tokens, q, point_mass & ~hit, hit)
    target_q = None if q is None else cfg.vocab.target_probs(q)
    if b_prefix is None:
        b_prefix = no_prefix(model.config, rows.last.shape[0], cfg.k, cfg.fmax)
    glue = b_prefix if hit_prefix is None else pick(hit, hit_prefix, b_prefix)
    return ds._replace(spec=spec, glue=glue), spec._replace(q=target_q), rank


@partial(jax.jit, static_argnames=("cfg",))
def _first_state(cfg: DraftConfig, prompt: tuple[Int[Array, "B T"], Int[Array, " B"]],
                 first: Int[Array, " B"], req: Requests, fan: FanLists, cache: KVCache
                 ) -> DraftState:
    (tokens, prompt_len), (B, T) = prompt, prompt[0].shape
    seen = (prompt_seen(tokens, prompt_len, cfg.vocab.target_size) if cfg.penalties
            else None)
    rows = start_rows(tokens, prompt_len, first, req, seen)
    history = jnp.zeros((B, cache.seq_len), jnp.int32).at[:, :T].set(tokens)
    history = history.at[jnp.arange(B), rows.lengths].set(rows.last)
    q = None if cfg.greedy_only else jnp.zeros((B, cfg.k, cfg.vocab.draft_size), jnp.float32)
    no = jnp.zeros_like(rows.done)
    placeholder = Speculation(jnp.zeros((B, cfg.k), jnp.int32), q, no, no)
    return DraftState(rows, cache, history, placeholder, fan)


def start(draft, cfg: DraftConfig, batch, first: Int[Array, " B"], cache: KVCache,
          fan: FanLists) -> tuple[DraftState, Speculation]:
    """After the target's prefill sampled `first`: the draft's prefill, its copy of the rows
    (rows.start_rows, as in the target's prefill) and the first speculation (a backup's).
    Everything is built inside programs, on the devices of the draft's inputs."""
    cache = draft.fill(cfg.vocab.draft_ids(batch.tokens), cache)
    ds = _first_state(cfg, (batch.tokens, batch.prompt_len), first, batch.req, fan, cache)
    ds, spec, _ = select(cfg, draft.leaves, ds, None, None, batch.req)
    return ds, spec
