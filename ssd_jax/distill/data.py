"""Distillation data: target responses from our AR engine, offline corpus text, and the target's
top-k next-token distribution at every position (a batched teacher-forced target forward).

Every stage writes numbered shards into the data directory and skips shards that exist, so an
interrupted run resumes where it stopped; the final `dataset.npz` holds, for N sequences of
length T (right-padded with 0):

    tokens   int32[N, T]       target token ids
    weight   float16[N, T]     loss weight of predicting tokens[:, t+1] from position t (0 on padding)
    top_ids  int32[N, T, k]    the target's k most likely next tokens at each position
    top_lp   float16[N, T, k]  their log-probabilities under the target's full softmax
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from ssd_jax.config import EngineConfig, SamplingParams
from ssd_jax.distill import prompts as P
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache

PROMPT_WEIGHT = 0.3  # prompt positions of chat data teach the template; responses matter most


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    seed: int = 0
    gen_batches: int = 12  # engine batches of `batch` prompts each
    batch: int = 32
    max_new_tokens: int = 128
    max_prompt_tokens: int = 127  # prompt + max_new_tokens + 1 <= 256: one compiled program
    sample_every: int = 4  # every 4th batch samples at temperature 0.8 instead of greedy
    corpus_chunks: int = 128  # 256-token windows of raw stdlib / Shakespeare text
    seq_len: int = 256
    top_k: int = 16
    label_batch: int = 8

    def __post_init__(self):
        if self.max_prompt_tokens + self.max_new_tokens >= self.seq_len:
            raise ValueError(f"max_prompt_tokens + max_new_tokens = "
                             f"{self.max_prompt_tokens + self.max_new_tokens} must be < "
                             f"seq_len={self.seq_len}: lower one of them")


def _chat_ids(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(chat, add_special_tokens=False)


def generate_responses(llm, cfg: DataConfig, out: Path) -> None:
    """Shards gen_XXXX.npz with prompt and response ids of `cfg.batch` chat prompts each."""
    need = cfg.gen_batches * cfg.batch
    pool = P.training_prompts(4 * need, seed=cfg.seed, cache_dir=out.parent)
    ids = [t for t in (_chat_ids(llm.tokenizer, p) for p in pool) if len(t) <= cfg.max_prompt_tokens]
    if len(ids) < need:
        raise RuntimeError(f"only {len(ids)} of the prompts fit in {cfg.max_prompt_tokens} tokens")
    ids = ids[:need]
    for b in tqdm(range(cfg.gen_batches), desc="target responses", unit="batch"):
        shard = out / f"gen_{b:04d}.npz"
        if shard.exists():
            continue
        rows = ids[b * cfg.batch:(b + 1) * cfg.batch]
        sample = b % cfg.sample_every == cfg.sample_every - 1
        params = [SamplingParams(max_new_tokens=cfg.max_new_tokens, seed=cfg.seed * 100003 + b * 1000 + i,
                                 temperature=0.8 if sample else 0.0, top_p=0.95 if sample else 1.0)
                  for i in range(len(rows))]
        res = llm.generate(rows, params, chat=False)
        seqs = [r + o.token_ids for r, o in zip(rows, res)]
        np.savez(shard, **_pack(seqs, [len(r) for r in rows], cfg.seq_len))


def corpus_chunks(tokenizer, cfg: DataConfig, out: Path) -> None:
    """corpus.npz: random windows of raw text (train-half stdlib modules and Shakespeare)."""
    shard = out / "corpus.npz"
    if shard.exists():
        return
    rng = random.Random(cfg.seed + 1)
    docs = list(P.stdlib_sources(training=True).values())
    plays = list(P.shakespeare_texts(out.parent).values())
    seqs = []
    for i in tqdm(range(cfg.corpus_chunks), desc="corpus windows"):
        text = rng.choice(docs if i % 3 else plays)  # two thirds code, one third prose
        start = rng.randrange(max(1, len(text) - 4000))
        toks = tokenizer.encode(text[start:start + 4000], add_special_tokens=False)
        seqs.append(toks[:cfg.seq_len])
    np.savez(shard, **_pack(seqs, [0] * len(seqs), cfg.seq_len))


def _pack(seqs: list[list[int]], prompt_lens: list[int], T: int) -> dict:
    tokens = np.zeros((len(seqs), T), np.int32)
    weight = np.zeros((len(seqs), T), np.float16)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        s = s[:T]
        tokens[i, :len(s)] = s
        weight[i, :len(s) - 1] = 1.0  # position t predicts token t+1
        weight[i, :max(0, p - 1)] = PROMPT_WEIGHT
    return {"tokens": tokens, "weight": weight}


@partial(jax.jit, static_argnames=("graphdef", "k"))
def _top_k(graphdef, params, tokens, empty: KVCache, *, k: int):
    B, T = tokens.shape
    model = nnx.merge(graphdef, params)
    logits, _ = model(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), empty,
                      jnp.zeros((B,), jnp.int32), causal_mask(B, T))
    vals, ids = jax.lax.top_k(logits, k)
    return ids, (vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True)).astype(jnp.float16)


def label(runner, tokens: np.ndarray, cfg: DataConfig, desc: str) -> tuple[np.ndarray, np.ndarray]:
    """The target's top-k next-token ids and log-probs at every position (teacher forcing).

    Sequences are bucketed to 128 or 256 positions (causal attention makes the trailing padding
    irrelevant to earlier positions), so two programs are compiled."""
    N, T = tokens.shape
    ids = np.zeros((N, T, cfg.top_k), np.int32)
    lp = np.full((N, T, cfg.top_k), -np.inf, np.float16)
    lengths = (tokens != 0).sum(1)  # id 0 (<|endoftext|>) only appears as padding here
    B = cfg.label_batch
    empty = runner.new_cache(B, 1)  # a passed-in (not constant) cache: nothing to constant-fold
    for start in tqdm(range(0, N, B), desc=desc, unit="batch"):
        rows = np.arange(start, min(start + B, N))
        width = 128 if lengths[rows].max() <= 128 else T
        x = np.zeros((B, width), np.int32)
        x[:len(rows)] = tokens[rows, :width]
        i, l = _top_k(runner.graphdef, runner.params, jnp.asarray(x), empty, k=cfg.top_k)
        ids[rows, :width] = np.asarray(i)[:len(rows)]
        lp[rows, :width] = np.asarray(l)[:len(rows)]
    return ids, lp


def build(out: Path, cfg: DataConfig = DataConfig(), *, model: str = "smollm2") -> Path:
    """Run every stage (each resumable) and write out/dataset.npz."""
    from ssd_jax import LLM

    out.mkdir(parents=True, exist_ok=True)
    final = out / "dataset.npz"
    if final.exists():
        return final
    llm = LLM(model, engine=EngineConfig(max_batch=cfg.batch, max_seq_len=cfg.seq_len,
                                         prefill_bucket=cfg.max_prompt_tokens + 1))
    generate_responses(llm, cfg, out)
    corpus_chunks(llm.tokenizer, cfg, out)
    parts = sorted(out.glob("gen_*.npz"))[:cfg.gen_batches] + [out / "corpus.npz"]
    for part in parts:
        labelled = part.with_name(part.stem + "_labels.npz")
        if labelled.exists():
            continue
        with np.load(part) as d:
            ids, lp = label(llm.runner, d["tokens"], cfg, f"target top-{cfg.top_k} ({part.stem})")
        np.savez(labelled, top_ids=ids, top_lp=lp)
    arrays = {k: [] for k in ("tokens", "weight", "top_ids", "top_lp")}
    for part in parts:
        with np.load(part) as d, np.load(part.with_name(part.stem + "_labels.npz")) as lab:
            for k in ("tokens", "weight"):
                arrays[k].append(d[k])
            for k in ("top_ids", "top_lp"):
                arrays[k].append(lab[k])
    np.savez(final, **{k: np.concatenate(v) for k, v in arrays.items()})
    return final
