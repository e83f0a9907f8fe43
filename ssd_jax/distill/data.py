"""Distillation data: target responses to training prompts, offline corpus text, and the target's
top-k next-token distribution at every position. Responses are labelled while they are generated
(the logits that produce a token are the labels of the position before it, so generation costs no
second pass); corpus windows are labelled by a batched teacher-forced target forward. A second,
on-policy stage (`build_onpolicy`) has a trained draft answer fresh prompts and labels those
answers with the target, teacher-forced.

Every stage writes numbered shards into the data directory and skips shards that exist, so an
interrupted run resumes where it stopped; the final `dataset.npz` holds, for N sequences of
length T (right-padded with 0):

    tokens   int32[N, T]       target token ids
    weight   float16[N, T]     loss weight of predicting tokens[:, t+1] from position t (0 on padding)
    top_ids  int32[N, T, k]    the target's k most likely next tokens at each position
    top_lp   float16[N, T, k]  their log-probabilities under the target's full softmax
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ssd_jax.config import EngineConfig
from ssd_jax.distill import prompts as P
from ssd_jax.loading.registry import DEFAULT_CACHE
from ssd_jax.models.attention import causal_mask
from ssd_jax.models.transformer import KVCache, commit
from ssd_jax.sampling import next_token

PROMPT_WEIGHT = 0.3  # prompt positions of chat data teach the template; responses matter most


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    seed: int = 0
    gen_batches: int = 40  # batches of `batch` prompts each
    batch: int = 32
    max_new_tokens: int = 128
    max_prompt_tokens: int = 127  # prompt + max_new_tokens + 1 <= 256: one compiled program
    sample_every: int = 4  # every 4th batch samples at temperature 0.8 instead of greedy
    corpus_chunks: int = 160  # 256-token windows of raw stdlib / Shakespeare text
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


def _chat_prompts(llm, cfg: DataConfig, need: int, *, seed: int):
    """`need` training prompts as chat-template ids that fit max_prompt_tokens, sorted by length,
    and the target's stop ids. Batches of similar prompt lengths need narrower prefills (widths
    are multiples of 32); the sort is global, so every sampled batch still spans the whole
    length range."""
    pool = P.training_prompts(4 * need, seed=seed, cache_dir=DEFAULT_CACHE)
    ids = [t for t in (_chat_ids(llm.tokenizer, p) for p in pool) if len(t) <= cfg.max_prompt_tokens]
    if len(ids) < need:
        raise RuntimeError(f"only {len(ids)} of the prompts fit in {cfg.max_prompt_tokens} tokens")
    stop = np.asarray(sorted(set(llm.model.config.eos_token_ids)), np.int32)
    return sorted(ids[:need], key=len), stop


def generate_responses(llm, cfg: DataConfig, out: Path) -> None:
    """Shards gen_XXXX.npz of `cfg.batch` chat prompts + target responses, labelled as they are
    generated: the logits the target computes to produce each token are the labels of the
    position before it, so the responses need no second (teacher-forced) pass."""
    ids, stop = _chat_prompts(llm, cfg, cfg.gen_batches * cfg.batch, seed=cfg.seed)
    for b in tqdm(range(cfg.gen_batches), desc="target responses (labelled)", unit="batch"):
        shard = out / f"gen_{b:04d}.npz"
        if shard.exists():
            continue
        rows = ids[b * cfg.batch:(b + 1) * cfg.batch]
        temp = 0.8 if b % cfg.sample_every == cfg.sample_every - 1 else 0.0
        seqs, labels = generate_labelled(llm.runner, rows, cfg, temperature=temp, stop_ids=stop,
                                         seed=cfg.seed * 100003 + b)
        packed = _pack(seqs, [len(r) for r in rows], cfg.seq_len)
        np.savez(shard, **packed, top_ids=labels[0], top_lp=labels[1])


@partial(jax.jit, static_argnames=("graphdef", "k"))
def _prefill_topk(graphdef, params, tokens, cache: KVCache, *, k: int):
    """Teacher-forced top-k at every position, and the tokens' K/V (prompts of generated data
    and corpus windows are labelled by this one program)."""
    B, T = tokens.shape
    no_prefix = jax.lax.optimization_barrier(jnp.zeros((B,), jnp.int32))  # see runner.prefill
    logits, new_kv = graphdef.merge(params)(
        tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), cache, no_prefix, causal_mask(B, T))
    return _log_top_k(logits, k), new_kv


@partial(jax.jit, static_argnames=("graphdef", "k"))
def _decode_topk(graphdef, params, tokens, lengths, cache: KVCache, key, temperature, *, k: int):
    """One step: top-k of the next-token distribution, and the next token (greedy, or sampled
    at `temperature` with top-p 0.95 for data diversity)."""
    B = tokens.shape[0]
    logits, new_kv = graphdef.merge(params)(
        tokens[:, None], lengths[:, None], cache, lengths, jnp.ones((B, 1, 1), bool))
    ids, lp = _log_top_k(logits, k)
    keys = jax.random.split(key, B)
    nxt = next_token(logits[:, 0], jnp.full((B,), temperature), jnp.zeros((B,), jnp.int32),
                     jnp.full((B,), jnp.where(temperature > 0, 0.95, 1.0)), keys)
    return (ids[:, 0], lp[:, 0]), nxt, new_kv


def _log_top_k(logits, k: int):
    vals, ids = jax.lax.top_k(logits, k)
    return ids, (vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True)).astype(jnp.float16)


def _padded(prompts: list[list[int]], cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompt block [B, P0] and the prompt lengths. The prefill is a third of the
    work: pad to the batch's longest prompt (one compiled program per multiple of 32), not to
    max_prompt_tokens."""
    plen = np.array([len(p) for p in prompts], np.int32)
    P0 = min(cfg.max_prompt_tokens + 1, -(-int(plen.max()) // 32) * 32)
    x = np.zeros((len(prompts), P0), np.int32)
    for i, p in enumerate(prompts):
        x[i, :len(p)] = p
    return x, plen


def generate_labelled(runner, prompts: list[list[int]], cfg: DataConfig, *, temperature: float,
                      stop_ids: np.ndarray, seed: int):
    """Prompt + response ids per row (the response ends after its first stop token or at
    max_new_tokens) and the target's top-k labels [B, seq_len, k] for every position."""
    B, T, k = len(prompts), cfg.seq_len, cfg.top_k
    x, plen = _padded(prompts, cfg)
    cache = runner.new_cache(B, T)
    (pids, plp), new_kv = _prefill_topk(runner.graphdef, runner.leaves, jnp.asarray(x), cache, k=k)
    cache = commit(cache, new_kv, jnp.zeros((B,), jnp.int32))
    ids = np.zeros((B, T, k), np.int32)
    lp = np.full((B, T, k), -np.inf, np.float16)
    pids, plp = np.asarray(pids), np.asarray(plp)
    rows = np.arange(B)
    for i in range(B):  # positions < prompt length (the last one predicts the first response token)
        ids[i, :plen[i]], lp[i, :plen[i]] = pids[i, :plen[i]], plp[i, :plen[i]]
    first = jnp.asarray(pids[rows, plen - 1, 0])
    if temperature > 0:  # sample the first token too
        first = next_token(jnp.asarray(_dense_logits(pids[rows, plen - 1], plp[rows, plen - 1],
                                                     runner.config.vocab_size)),
                           jnp.full((B,), temperature), jnp.zeros((B,), jnp.int32),
                           jnp.full((B,), 0.95), jax.random.split(jax.random.key(seed), B))
    tok, lengths = np.asarray(first, np.int32), plen.copy()
    out = [[int(t)] for t in tok]
    done = np.isin(tok, stop_ids)
    key = jax.random.key(seed + 1)
    for step in range(cfg.max_new_tokens - 1):
        if done.all():
            break
        (sids, slp), nxt, new_kv = _decode_topk(runner.graphdef, runner.leaves, jnp.asarray(tok),
                                                 jnp.asarray(lengths), cache,
                                                 jax.random.fold_in(key, step), temperature, k=k)
        cache = commit(cache, new_kv, jnp.asarray(lengths))
        sids, slp, nxt = np.asarray(sids), np.asarray(slp), np.asarray(nxt)
        live = ~done
        ids[rows[live], lengths[live]], lp[rows[live], lengths[live]] = sids[live], slp[live]
        lengths = np.where(live, lengths + 1, lengths)
        tok = np.where(live, nxt, tok)
        for i in np.flatnonzero(live):
            out[i].append(int(nxt[i]))
        done |= live & np.isin(nxt, stop_ids)
    return [p + o for p, o in zip(prompts, out)], (ids, lp)


def _dense_logits(top_ids, top_lp, vocab: int) -> np.ndarray:
    """Logits that are the top-k log-probs and -inf elsewhere (sampling the first token from
    the top-k is what top-p 0.95 nearly always keeps anyway)."""
    dense = np.full((len(top_ids), vocab), -np.inf, np.float32)
    np.put_along_axis(dense, top_ids, top_lp.astype(np.float32), axis=1)
    return dense


def corpus_chunks(tokenizer, cfg: DataConfig, out: Path) -> None:
    """corpus.npz: random windows of raw text (train-half stdlib modules and Shakespeare)."""
    shard = out / "corpus.npz"
    if shard.exists():
        return
    rng = random.Random(cfg.seed + 1)
    docs = list(P.stdlib_sources(training=True).values())
    plays = list(P.shakespeare_texts(DEFAULT_CACHE).values())
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


def label(runner, tokens: np.ndarray, cfg: DataConfig, desc: str,
          progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The target's top-k next-token ids and log-probs at every position (teacher forcing).

    Sequences are bucketed to multiples of 64 positions (causal attention makes the trailing
    padding irrelevant to earlier positions), so at most seq_len / 64 programs are compiled."""
    N, T = tokens.shape
    ids = np.zeros((N, T, cfg.top_k), np.int32)
    lp = np.full((N, T, cfg.top_k), -np.inf, np.float16)
    # Length = last non-padding position + 1 (a generated <|endoftext|>, id 0, may sit inside).
    lengths = np.where(tokens != 0, np.arange(T) + 1, 0).max(1)
    B = cfg.label_batch
    empty = runner.new_cache(B, 1)  # a passed-in (not constant) cache: nothing to constant-fold
    for start in tqdm(range(0, N, B), desc=desc, unit="batch", disable=not progress):
        rows = np.arange(start, min(start + B, N))
        width = min(T, -(-int(lengths[rows].max()) // 64) * 64)
        x = np.zeros((B, width), np.int32)
        x[:len(rows)] = tokens[rows, :width]
        (i, l), _ = _prefill_topk(runner.graphdef, runner.leaves, jnp.asarray(x), empty,
                                  k=cfg.top_k)
        ids[rows, :width] = np.asarray(i)[:len(rows)]
        lp[rows, :width] = np.asarray(l)[:len(rows)]
    return ids, lp


def _claim(out: Path, cfg: DataConfig, model: str, **extra) -> None:
    """Shards are reused on resume, so a folder must only ever hold one configuration's data:
    record it on first use and refuse a different one (instead of silently mixing the two)."""
    meta = out / "config.json"
    want = json.dumps({**asdict(cfg), "model": model, "prompts": P.fingerprint(), **extra},
                      indent=1, sort_keys=True)
    if meta.exists() and meta.read_text() != want:
        raise ValueError(f"{out} holds distillation data built with another configuration (see "
                         f"{meta}); pass another --out folder, or delete this one to rebuild")
    if not meta.exists():
        meta.write_text(want)


def build(out: Path, cfg: DataConfig = DataConfig(), *, model: str = "smollm2") -> Path:
    """Run every stage (each resumable) and write out/dataset.npz."""
    from ssd_jax import LLM

    out.mkdir(parents=True, exist_ok=True)
    _claim(out, cfg, model)
    final = out / "dataset.npz"
    if final.exists():
        return final
    llm = LLM(model, engine=EngineConfig(max_batch=cfg.batch, max_seq_len=cfg.seq_len,
                                         prefill_bucket=cfg.max_prompt_tokens + 1))
    generate_responses(llm, cfg, out)
    corpus_chunks(llm.tokenizer, cfg, out)
    parts = sorted(out.glob("gen_*.npz"))[:cfg.gen_batches] + [out / "corpus.npz"]
    arrays = {k: [] for k in ("tokens", "weight", "top_ids", "top_lp")}
    for part in parts:
        with np.load(part) as d:
            shard = dict(d)
        if "top_ids" not in shard:  # corpus text: labelled by a teacher-forced pass
            labelled = part.with_name(part.stem + "_labels.npz")
            if not labelled.exists():
                ids, lp = label(llm.runner, shard["tokens"], cfg,
                                f"target top-{cfg.top_k} ({part.stem})")
                np.savez(labelled, top_ids=ids, top_lp=lp)
            with np.load(labelled) as lab:
                shard.update(top_ids=lab["top_ids"], top_lp=lab["top_lp"])
        for k in arrays:
            arrays[k].append(shard[k])
    np.savez(final, **{k: np.concatenate(v) for k, v in arrays.items()})
    return final


# ------------------------------------------------------------------ on-policy data
ONPOLICY_SEED = 7919  # prompt stream of the on-policy stage: not the target stage's prompts


@partial(jax.jit, static_argnames=("graphdef", "temperature", "banned"))
def _sample_step(graphdef, params, tokens, positions, cache: KVCache, prefix_len, mask, pick,
                 key, temperature: float, banned: int | None):
    """Logits at `pick` [B] -> next token: argmax at temperature 0, else a plain categorical
    sample at `temperature` (Gumbel-max: no vocabulary sort, unlike top-p). Token `banned`
    (a draft's OOV slot, which stands for no token at all) is never produced."""
    logits, new_kv = graphdef.merge(params)(tokens, positions, cache, prefix_len, mask,
                                                 pick[:, None])
    logits = logits[:, 0]
    if banned is not None:
        logits = logits.at[:, banned].set(-jnp.inf)
    if temperature > 0:
        return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32), new_kv
    return jnp.argmax(logits, -1).astype(jnp.int32), new_kv


def draft_generate(runner, prompts: list[list[int]], cfg: DataConfig, *, temperature: float,
                   stop_ids: np.ndarray, seed: int, banned: int | None = None) -> list[list[int]]:
    """Prompt + response ids per row, generated by the (cheap) model of `runner` without labels."""
    B, T = len(prompts), cfg.seq_len
    x, plen = _padded(prompts, cfg)
    P0 = x.shape[1]
    cache = runner.new_cache(B, T)
    key = jax.random.key(seed)
    tok, new_kv = _sample_step(runner.graphdef, runner.leaves, jnp.asarray(x),
                               jnp.broadcast_to(jnp.arange(P0), (B, P0)), cache,
                               jnp.zeros((B,), jnp.int32), causal_mask(B, P0),
                               jnp.asarray(plen - 1), key, temperature, banned)
    cache = commit(cache, new_kv, jnp.zeros((B,), jnp.int32))
    tok, lengths = np.asarray(tok), plen.copy()
    out = [[int(t)] for t in tok]
    done = np.isin(tok, stop_ids)
    for step in range(cfg.max_new_tokens - 1):
        if done.all():
            break
        nxt, new_kv = _sample_step(runner.graphdef, runner.leaves, jnp.asarray(tok)[:, None],
                                   jnp.asarray(lengths)[:, None], cache, jnp.asarray(lengths),
                                   jnp.ones((B, 1, 1), bool), jnp.zeros((B,), jnp.int32),
                                   jax.random.fold_in(key, step + 1), temperature, banned)
        cache = commit(cache, new_kv, jnp.asarray(lengths))
        nxt, live = np.asarray(nxt), ~done
        lengths = np.where(live, lengths + 1, lengths)
        tok = np.where(live, nxt, tok)
        for i in np.flatnonzero(live):
            out[i].append(int(nxt[i]))
        done |= live & np.isin(nxt, stop_ids)
    return [p + o for p, o in zip(prompts, out)]


def draft_responses(llm, draft, cfg: DataConfig, out: Path, *, batches: int) -> None:
    """Shards pol_XXXX.npz: the *draft* answers fresh training prompts (every other batch
    sampled at T=0.8, the rest greedy) and the target labels every position teacher-forced.

    This is on-policy distillation (DistillSpec, Zhou et al. 2024): the draft is taught the
    target's distribution on the prefixes it itself produces, which is where its proposals
    go wrong. It is also ~3x cheaper per labelled position here than target generation: a
    teacher-forced target pass costs ~2.3 ms/token on 2 cores, a batched target decode step
    ~9 ms/token (its attention re-reads the whole cache every step), and the draft's own
    decode is nearly free."""
    ids, stop = _chat_prompts(llm, cfg, batches * cfg.batch, seed=cfg.seed + ONPOLICY_SEED)
    for b in tqdm(range(batches), desc="draft responses (target-labelled)", unit="batch"):
        shard = out / f"pol_{b:04d}.npz"
        if shard.exists():
            continue
        np.savez(shard, **onpolicy_batch(llm.runner, draft, ids[b * cfg.batch:(b + 1) * cfg.batch],
                                         cfg, temperature=0.8 if b % 2 else 0.0, stop_ids=stop,
                                         seed=cfg.seed * 100003 + ONPOLICY_SEED + b))


def onpolicy_batch(target_runner, draft, prompts: list[list[int]], cfg: DataConfig, *,
                   temperature: float, stop_ids: np.ndarray, seed: int) -> dict:
    """The draft answers `prompts` (target ids); the target labels prompt + answer teacher-forced.
    Returns the arrays of one shard (see the module docstring)."""
    from ssd_jax.core.runner import ModelRunner

    # The draft runs in its own vocabulary (8k ids, not the target's 49k: its head and the
    # sampling stay small); its tokens map back to target ids.
    to_draft = np.asarray(draft.to_draft[...])
    to_target = np.zeros(draft.oov + 1, np.int32)
    inside = np.flatnonzero(to_draft != draft.oov)
    to_target[to_draft[inside]] = inside
    # XLA's products: the draft may be trained on after this, and a model packed for the CPU
    # kernel (runner.py) has no gradient.
    answers = draft_generate(ModelRunner(draft.model, cpu_kernels=False),
                             [to_draft[p].tolist() for p in prompts],
                             cfg, temperature=temperature, stop_ids=to_draft[stop_ids], seed=seed,
                             banned=draft.oov)
    seqs = [p + to_target[a[len(p):]].tolist() for p, a in zip(prompts, answers)]
    packed = _pack(seqs, [len(p) for p in prompts], cfg.seq_len)
    top_ids, top_lp = label(target_runner, packed["tokens"], cfg, "", progress=False)
    return {**packed, "top_ids": top_ids, "top_lp": top_lp}


def _checkpoint_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def build_onpolicy(out: Path, base: Path, draft_path: Path, cfg: DataConfig = DataConfig(), *,
                   batches: int, model: str = "smollm2") -> Path:
    """out/dataset.npz = the base dataset (target responses + corpus) followed by `batches`
    on-policy shards from the draft checkpoint at `draft_path` (resumable like `build`)."""
    from ssd_jax import LLM
    from ssd_jax.draft_vocab import DraftModel

    if not Path(base).exists():
        raise FileNotFoundError(f"{base} does not exist: run `python -m ssd_jax.distill data` "
                                "first (it writes the base dataset.npz)")
    if not (Path(draft_path) / "ssd_jax_config.json").exists():
        raise FileNotFoundError(f"{draft_path} is not a draft checkpoint folder (no "
                                "ssd_jax_config.json): pass --draft the --out folder of a "
                                "`python -m ssd_jax.distill train` run")
    out.mkdir(parents=True, exist_ok=True)
    _claim(out, cfg, model, base=str(Path(base).resolve()), draft=_checkpoint_hash(draft_path),
           onpolicy_batches=batches)
    final = out / "dataset.npz"
    if final.exists():
        return final
    llm = LLM(model, engine=EngineConfig(max_batch=cfg.batch, max_seq_len=cfg.seq_len,
                                         prefill_bucket=cfg.max_prompt_tokens + 1))
    draft, _ = DraftModel.load(str(draft_path))
    draft_responses(llm, draft, cfg, out, batches=batches)
    with np.load(base) as d:
        arrays = {k: [d[k]] for k in ("tokens", "weight", "top_ids", "top_lp")}
    for part in sorted(out.glob("pol_*.npz"))[:batches]:
        with np.load(part) as d:
            for k in arrays:
                arrays[k].append(d[k])
    np.savez(final, **{k: np.concatenate(v) for k, v in arrays.items()})
    return final
