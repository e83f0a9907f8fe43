"""Test oracles shared by several test files: independent of the code under test.

Test files import from here (or take conftest fixtures), never from each other.

- `chi2_pvalue`: goodness of fit of sampled counts to an exact law (one helper for every
  distribution test; drawing something the law rules out fails outright).
- `exact_sequence_probs`: the target's exact law of its first tokens, by enumerating every
  continuation through transformers (the reference for sampled SD and SSD).
- `penalised_logits`: presence / frequency / repetition penalties, token by token.
- `token_logprobs`: transformers' log_softmax at the positions that predicted each emitted token
  (one forward over prompt + output: no cache, no speculation).
- `dequantize`: a numpy decoder of ggml's quantised blocks (Q8_0, Q5_0, Q4_K, Q6_K), written from
  ggml's block layouts (ggml-common.h, dequantize_row_* in ggml-quants.c), not from gguf-py.
"""
from __future__ import annotations

import itertools

import gguf
import numpy as np
import scipy.stats

P_MIN = 1e-3  # chi-square p-value below which a sampler is declared wrong (fixed seeds)


def chi2_pvalue(counts, probs) -> float:
    """Chi-square p-value of observed `counts` against exact probabilities `probs`.

    Either two arrays over the same categories, or two dicts keyed by category (e.g. tuples of
    token ids; a category absent from `probs` has probability 0). A category with probability
    0 that was drawn at all gives p = 0 outright: pooled with the rare cells it would hide.
    Cells expected fewer than 5 times are pooled into one, as the chi-square approximation
    needs."""
    if isinstance(counts, dict) or isinstance(probs, dict):
        keys = sorted(set(counts) | set(probs))
        counts = [counts.get(k, 0) for k in keys]
        probs = [probs.get(k, 0.0) for k in keys]
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    if counts.shape != probs.shape:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} differ in shape")
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0  # the pooled cell is empty when every cell is big
    return float(scipy.stats.chisquare(obs[keep], exp[keep]).pvalue)


def sequence_counts(llm, mode: str, n_out: int, n_samples: int = 3200, prompt=(1, 2, 3)
                    ) -> dict:
    """How often each first-`n_out`-token continuation of `prompt` came out of `llm` in
    `mode`, sampled at T = 1 with seeds 0..n_samples-1, 64 rows a call."""
    from ssd_jax import SamplingParams  # the one helper here that drives ssd_jax
    counts = {}
    for start in range(0, n_samples, 64):
        outs = llm.generate([list(prompt)] * 64, [SamplingParams(
            temperature=1.0, max_new_tokens=n_out, seed=start + i, ignore_eos=True)
            for i in range(64)], mode=mode)
        for o in outs:
            key = tuple(o.token_ids[:n_out])
            counts[key] = counts.get(key, 0) + 1
    return counts


def exact_sequence_probs(hf_model, prompt: list[int], temperature: float, top_p: float,
                         n_out: int, bias: dict[int, float] | None = None,
                         no_stop: tuple[list[int], int] = ((), 0),
                         penalties: tuple[float, float, float] | None = None,
                         min_p: float = 0.0) -> dict[tuple[int, ...], float]:
    """P(first n_out tokens after `prompt`) under a (tiny-vocabulary) transformers model, for
    every sequence: one batched forward over all V^n_out continuations, `bias` (OpenAI's
    logit_bias) added to the logits, then `penalties` = (presence, frequency, repetition)
    (penalised_logits), `no_stop` = (ids, m) banned from the first m tokens (vLLM's
    min_tokens), temperature, min-p (vLLM's: tokens below min_p times the top one's dropped,
    before top-p) and top-p applied in float64 numpy."""
    import torch
    V = hf_model.config.vocab_size
    seqs = list(itertools.product(range(V), repeat=n_out))
    ids = torch.tensor([list(prompt) + list(s) for s in seqs])
    with torch.no_grad():
        logits = hf_model(ids).logits.double().numpy()[:, len(prompt) - 1:-1]  # [N, n_out, V]
    for t, v in (bias or {}).items():
        logits[..., t] += v
    if penalties is not None:
        for n, seq in enumerate(seqs):
            for i in range(n_out):
                logits[n, i] = penalised_logits(logits[n, i], prompt, seq[:i], *penalties)
    ids_banned, m = no_stop
    for t in ids_banned:
        logits[:, :m, t] = -np.inf
    p = np.exp(logits / temperature - (logits / temperature).max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if min_p > 0:
        p = np.where(p >= min_p * p.max(-1, keepdims=True), p, 0)
        p /= p.sum(-1, keepdims=True)
    if top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        above = np.cumsum(sorted_p, -1) - sorted_p
        keep_sorted = above < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0)
        p /= p.sum(-1, keepdims=True)
    toks = np.array(seqs)
    per_tok = np.take_along_axis(p, toks[..., None], -1)[..., 0]
    return dict(zip(seqs, per_tok.prod(-1)))


def penalised_logits(logits, prompt, answer, presence: float, frequency: float,
                     repetition: float) -> np.ndarray:
    """One position's logits after the penalties, token by token as vLLM's documentation
    states them: a token that occurs in the prompt or in the answer so far has its logit
    divided by `repetition` if positive, else multiplied by it; then each token loses
    `frequency` times its count in the answer, and `presence` if it occurs there at all."""
    out = np.array(logits, np.float64)
    for v in range(out.shape[-1]):
        c = list(answer).count(v)
        if c > 0 or v in prompt:
            out[v] = out[v] / repetition if out[v] > 0 else out[v] * repetition
        out[v] -= frequency * c + presence * (c > 0)
    return out


# --- an independent decoder of ggml's block layouts -----------------------------------------

Q = gguf.GGMLQuantizationType
QK_K = 256  # elements per K-quant super-block; Q8_0 and Q5_0 blocks hold 32


def token_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens), vocab]: row i is the log-probability law that predicted tokens[i]."""
    import torch
    ids = torch.tensor([list(prompt) + list(tokens[:-1])])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1:].double()
    return torch.log_softmax(logits, -1).numpy()


def f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] little-endian half-float bytes -> [n] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[:, 0].astype(np.float32)


def _dequant_q8_0(b):  # block_q8_0: half d; int8 qs[32]
    return f16(b[:, 0:2])[:, None] * b[:, 2:34].view(np.int8).astype(np.float32)


def _dequant_q5_0(b):  # block_q5_0: half d; uint8 qh[4] (32 fifth bits); uint8 qs[16]
    d = f16(b[:, 0:2])[:, None]
    qh = np.ascontiguousarray(b[:, 2:6]).view("<u4").astype(np.int64)  # [n, 1]
    qs = b[:, 6:22].astype(np.int64)
    j = np.arange(16)
    x0 = ((qs & 0x0F) | (((qh >> j) << 4) & 0x10)) - 16  # element j
    x1 = ((qs >> 4) | ((qh >> (j + 12)) & 0x10)) - 16  # element j + 16
    return d * np.concatenate([x0, x1], axis=1).astype(np.float32)


def _scale_min_k4(j: int, s: np.ndarray):  # ggml's get_scale_min_k4 over [n, 12] scale bytes
    s = s.astype(np.int64)
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return ((s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4),
            (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4))


def _dequant_q4_k(b):  # block_q4_K: half d, dmin; uint8 scales[12]; uint8 qs[128]
    d, dmin = f16(b[:, 0:2])[:, None], f16(b[:, 2:4])[:, None]
    scales, qs = b[:, 4:16], b[:, 16:144].astype(np.int64)
    out = []
    for c in range(4):  # 64 elements per chunk: low nibbles, then high nibbles of 32 bytes
        q = qs[:, 32 * c:32 * c + 32]
        for sub, nib in ((2 * c, q & 0xF), (2 * c + 1, q >> 4)):
            sc, m = _scale_min_k4(sub, scales)
            out.append(d * sc[:, None] * nib - dmin * m[:, None])
    return np.concatenate(out, axis=1).astype(np.float32)


def _dequant_q6_k(b):  # block_q6_K: uint8 ql[128], qh[64]; int8 scales[16]; half d
    ql, qh = b[:, 0:128].astype(np.int64), b[:, 128:192].astype(np.int64)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = f16(b[:, 208:210])[:, None]
    y = np.empty((b.shape[0], QK_K), np.float32)
    for h in range(2):  # two halves of 128 elements
        lo, hi, s = ql[:, 64 * h:64 * h + 64], qh[:, 32 * h:32 * h + 32], sc[:, 8 * h:8 * h + 8]
        l = np.arange(32)
        q1 = ((lo[:, :32] & 0xF) | (((hi >> 0) & 3) << 4)) - 32
        q2 = ((lo[:, 32:] & 0xF) | (((hi >> 2) & 3) << 4)) - 32
        q3 = ((lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4)) - 32
        q4 = ((lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)) - 32
        for k, qk in enumerate((q1, q2, q3, q4)):
            y[:, 128 * h + 32 * k + l] = d * s[:, 2 * k + l // 16] * qk
    return y


# qtype -> (elements per block, bytes per block, block decoder)
BLOCKS = {Q.Q8_0: (32, 34, _dequant_q8_0), Q.Q5_0: (32, 22, _dequant_q5_0),
          Q.Q4_K: (QK_K, 144, _dequant_q4_k), Q.Q6_K: (QK_K, 210, _dequant_q6_k)}


def dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    """[rows, bytes] uint8 blocks -> [rows, cols] float32, for Q8_0/Q5_0/Q4_K/Q6_K."""
    elems, nbytes, fn = BLOCKS[Q(qtype)]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    return fn(raw.reshape(-1, nbytes)).reshape(rows, -1)


def read_metadata(reader) -> dict:
    """GGUF metadata as the gguf package reads it: the oracle for our own header reader."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # exotic field types we do not need
            continue
    return meta
