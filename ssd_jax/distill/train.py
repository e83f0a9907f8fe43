"""Knowledge distillation of the draft on the target's top-k next-token distributions.

Loss per position t (weighted by the data's `weight`): the cross-entropy of the draft's softmax
against the target's top-k probabilities (renormalised over the k; tokens outside the draft
vocabulary pool into the OOV slot), plus `ce_weight` x the cross-entropy on the target's argmax,
which is the token greedy verification accepts. AdamW with linear warmup and cosine decay
(over steps, or over a wall-time budget if that runs out first).

Resumable: every `ckpt_every` steps the params, optimizer state and step go to WORK/state.npz
(atomically); a restart restores them, and since batch i is drawn from a generator seeded with
(seed, i), it continues with exactly the batches an uninterrupted run would have seen.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from ssd_jax.config import ModelConfig
from ssd_jax.draft_vocab import VocabMap
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, Transformer

log = logging.getLogger(__name__)
SPECIAL_IDS = (0, 1, 2)  # <|endoftext|>, <|im_start|>, <|im_end|>: the chat template needs them


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 3000
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 40
    weight_decay: float = 0.05
    ce_weight: float = 0.5
    seed: int = 0
    ckpt_every: int = 200
    eval_every: int = 100
    max_minutes: float = 0.0  # 0 = no wall-time limit; else the schedule ends by then
    draft_vocab: int = 8192
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768


def draft_config(cfg: TrainConfig, target: ModelConfig) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=cfg.draft_vocab, hidden_size=cfg.hidden,
                       intermediate_size=cfg.intermediate, num_layers=cfg.layers,
                       num_heads=cfg.heads, num_kv_heads=cfg.kv_heads,
                       head_dim=cfg.hidden // cfg.heads, rms_norm_eps=target.rms_norm_eps,
                       rope_theta=target.rope_theta, tie_embeddings=True,
                       max_position_embeddings=target.max_position_embeddings,
                       bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids)


def select_vocab(tokens: np.ndarray, weight: np.ndarray, top_ids: np.ndarray,
                 draft_size: int, target_size: int) -> VocabMap:
    """The draft_size - 1 target tokens that occur most often as inputs or as the target's
    argmax (ties broken by id), always including the chat-template specials."""
    counts = np.bincount(tokens[weight > 0].ravel(), minlength=target_size).astype(np.float64)
    counts += np.bincount(top_ids[..., 0][weight > 0].ravel(), minlength=target_size)
    counts[list(SPECIAL_IDS)] = np.inf
    order = np.lexsort((np.arange(target_size), -counts))
    return VocabMap.from_target_ids(np.sort(order[:draft_size - 1]), target_size)


def init_embeddings(model: Transformer, target_embed: np.ndarray, vocab: VocabMap) -> None:
    """Start from the target's embeddings projected on their top principal directions: tokens
    the target treats alike start alike (the target ties embeddings, so this is its head too)."""
    rows = target_embed[vocab.to_target[:-1]]
    rows = rows - rows.mean(0)
    _, _, vt = np.linalg.svd(rows, full_matrices=False)
    proj = rows @ vt[:model.config.hidden_size].T
    proj = np.concatenate([proj, proj.mean(0, keepdims=True)])  # OOV: the average token
    proj *= 0.02 / proj.std()
    model.embed_tokens.embedding.set_value(jnp.asarray(proj, jnp.float32))


def kd_loss(model: Transformer, empty: KVCache, tokens, weight, top_draft, top_p,
            ce_weight: float):
    """tokens/weight [B,T] (draft ids), top_draft [B,T,k] draft ids, top_p [B,T,k] probs.
    `empty` is a 1-slot cache passed in (a cache built inside the jit is a constant that XLA
    spends compile time folding)."""
    B, T = tokens.shape
    logits, _ = model(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), empty,
                      jnp.zeros((B,), jnp.int32), causal_mask(B, T))
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, top_draft, axis=-1)  # [B,T,k]
    kd = -(top_p * picked).sum(-1)
    ce = -picked[..., 0]
    per_pos = kd + ce_weight * ce
    agree = (jnp.argmax(logits, -1) == top_draft[..., 0])
    wsum = jnp.maximum(weight.sum(), 1.0)
    return (per_pos * weight).sum() / wsum, (agree * (weight > 0)).sum() / jnp.maximum(
        (weight > 0).sum(), 1)


@nnx.jit(static_argnames=("ce_weight",))
def train_step(model, optimizer, empty, tokens, weight, top_draft, top_p, ce_weight: float):
    def loss_fn(m):
        return kd_loss(m, empty, tokens, weight, top_draft, top_p, ce_weight)
    (loss, agree), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, agree


@nnx.jit(static_argnames=("ce_weight",))
def eval_step(model, empty, tokens, weight, top_draft, top_p, ce_weight: float):
    return kd_loss(model, empty, tokens, weight, top_draft, top_p, ce_weight)


class Batches:
    """The dataset in draft ids, with batch i a pure function of (seed, i)."""

    def __init__(self, data: dict, vocab: VocabMap, seed: int, batch: int):
        to_draft = vocab.to_draft
        self.tokens = to_draft[data["tokens"]]
        self.weight = data["weight"].astype(np.float32)
        self.top_draft = to_draft[data["top_ids"]]
        lp = data["top_lp"].astype(np.float32)
        lp = np.where(np.isfinite(lp), lp, -1e4)  # unlabelled padding positions (weight 0)
        p = np.exp(lp - lp.max(-1, keepdims=True))
        self.top_p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
        self.seed, self.batch, self.n = seed, batch, len(self.tokens)

    def rows(self, rows):
        return tuple(jnp.asarray(a[rows]) for a in (self.tokens, self.weight, self.top_draft,
                                                     self.top_p))

    def all_rows(self) -> list[tuple]:
        """Every sequence once, in full batches (repeats padded in with zero weight)."""
        idx = np.arange(-(-self.n // self.batch) * self.batch)
        out = []
        for i in range(0, len(idx), self.batch):
            b = list(self.rows(idx[i:i + self.batch] % self.n))
            b[1] = jnp.where(jnp.asarray(idx[i:i + self.batch] < self.n)[:, None], b[1], 0.0)
            out.append(tuple(b))
        return out

    def __call__(self, i: int):
        rng = np.random.default_rng([self.seed, i])
        return self.rows(rng.choice(self.n, self.batch, replace=self.n < self.batch))


def make_optimizer(model, cfg: TrainConfig) -> nnx.Optimizer:
    # The learning rate is a hyperparameter set from the host each step (see `learning_rate`),
    # so a wall-time budget can end the cosine decay on time instead of cutting it off.
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=0.9, b2=0.98,
                                                           weight_decay=cfg.weight_decay))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def learning_rate(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Linear warmup, then cosine decay to 5% over the progress max(step / steps, time / budget)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = step / cfg.steps
    if cfg.max_minutes:
        progress = max(progress, elapsed_s / (60 * cfg.max_minutes))
    progress = min(progress, 1.0)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * progress)))


def save_state(path: Path, model, optimizer, step: int, elapsed_s: float) -> None:
    leaves = jax.tree.leaves(nnx.state((model, optimizer)))
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, step=step, elapsed_s=elapsed_s, **{f"l{i}": np.asarray(x) for i, x in enumerate(leaves)})
    tmp.rename(path)  # never leave a half-written state behind


def restore_state(path: Path, model, optimizer) -> tuple[int, float]:
    state = nnx.state((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)
    with np.load(path) as d:
        new = [jnp.asarray(d[f"l{i}"], dtype=x.dtype) for i, x in enumerate(leaves)]
        step, elapsed = int(d["step"]), float(d["elapsed_s"])
    nnx.update((model, optimizer), jax.tree.unflatten(treedef, new))
    return step, elapsed


def train(model, batches: Batches, cfg: TrainConfig, work: Path, held_out=None,
          log=print) -> dict:
    """Run (or resume) training to cfg.steps; returns a summary dict."""
    work.mkdir(parents=True, exist_ok=True)
    optimizer = make_optimizer(model, cfg)
    state_path = work / "state.npz"
    step, before = restore_state(state_path, model, optimizer) if state_path.exists() else (0, 0.0)
    if step:
        log(f"resumed from {state_path} at step {step}")
    t0, losses, last_eval, done = time.perf_counter() - before, [], None, step
    lr = optimizer.opt_state[1].hyperparams["learning_rate"]
    empty = KVCache.zeros(model.config, batches.batch, 1)
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc="distill", unit="step")
    for step in bar:
        lr.set_value(jnp.asarray(learning_rate(cfg, step, time.perf_counter() - t0), jnp.float32))
        loss, agree = train_step(model, optimizer, empty, *batches(step), ce_weight=cfg.ce_weight)
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=f"{float(agree):.3f}")
        done = step + 1
        elapsed = time.perf_counter() - t0
        out_of_time = bool(cfg.max_minutes) and elapsed > 60 * cfg.max_minutes
        last = done == cfg.steps or out_of_time
        if held_out is not None and (done % cfg.eval_every == 0 or last):
            ev = [eval_step(model, empty, *held_out[j], ce_weight=cfg.ce_weight)
                  for j in range(len(held_out))]
            last_eval = {"step": done, "loss": float(np.mean([e[0] for e in ev])),
                         "top1_agreement": float(np.mean([e[1] for e in ev]))}
            log(f"held-out at step {done}: {last_eval}")
        if done % cfg.ckpt_every == 0 or last:
            save_state(state_path, model, optimizer, done, elapsed)
        if out_of_time:
            log(f"stopping at step {done}: the {cfg.max_minutes} min budget is spent")
            break
    return {"steps": done, "first_loss": losses[0] if losses else None,
            "last_loss": float(np.mean(losses[-20:])) if losses else None,
            "train_s": time.perf_counter() - t0, "held_out": last_eval}


def run(data_path: Path, work: Path, out: Path, cfg: TrainConfig = TrainConfig(),
        init: Path | None = None) -> Path:
    """Load data and target, build the draft (or continue the draft checkpoint `init`, keeping
    its architecture and vocabulary), train (resumable), export the orbax checkpoint."""
    from ssd_jax.loading import load, orbax_ckpt

    if not Path(data_path).exists():
        raise FileNotFoundError(f"{data_path} does not exist: build it with `python -m "
                                "ssd_jax.distill data` (or `onpolicy`), or pass --data")
    target, tokenizer, _ = load("smollm2")
    data = dict(np.load(data_path))
    is_eval = np.arange(len(data["tokens"])) % 40 == 39  # held out, for monitoring only
    train_data = {k: v[~is_eval] for k, v in data.items()}
    eval_data = {k: v[is_eval] for k, v in data.items()}
    if init is not None:
        model, _, extra = load(str(init))
        if "vocab_map" not in extra:
            raise ValueError(f"--init {init} is not a draft checkpoint (no vocab_map): pass one "
                             "written by `python -m ssd_jax.distill train`")
        vocab = VocabMap.from_dict(extra["vocab_map"])
    else:
        vocab = select_vocab(train_data["tokens"], train_data["weight"], train_data["top_ids"],
                             cfg.draft_vocab, target.config.vocab_size)
    w = train_data["weight"] == 1
    covered = float((vocab.to_draft[train_data["top_ids"][..., 0][w]] != vocab.oov).mean())
    log.info("draft vocab %d: covers %.4f of the target's argmax tokens", vocab.draft_size,
             covered)
    if init is None:
        model = Transformer(draft_config(cfg, target.config), rngs=nnx.Rngs(cfg.seed))
        init_embeddings(model, np.asarray(target.embed_tokens.embedding.get_value()), vocab)
    del target
    batches = Batches(train_data, vocab, cfg.seed, cfg.batch)
    ev = Batches(eval_data, vocab, cfg.seed, cfg.batch)
    held_out = ev.all_rows() if ev.n else None
    summary = train(model, batches, cfg, work, held_out)
    summary.update(vocab_coverage=covered, train_sequences=int(batches.n), eval_sequences=int(ev.n),
                   config=asdict(cfg), init=str(init) if init else None)
    log.info("training summary:\n%s", json.dumps(summary, indent=1))
    orbax_ckpt.save(model, tokenizer, out, extra={"vocab_map": vocab.to_dict(), "distill": summary})
    return out
