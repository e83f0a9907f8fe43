"""Predicted AR / SD / SSD decode throughput: a per-device roofline per forward, combined with the
speculative speed models (ssd-algorithm.md section 4, Theorem 7).

One forward of T tokens per row on a TP mesh takes, per device,
    max(HBM bytes / bandwidth, FLOPs / peak) + collectives + fixed overhead
with HBM bytes = weight shard (an untied embedding table is not streamed: only B*T rows are read)
+ the KV prefix of every row + new K/V + extra buffers, and FLOPs = 2 per matmul weight per
token + 4*L*H*D per (query, cached key) pair. Collectives (TP > 1): an all-reduce of the hidden
state after attention and after the MLP of every layer, one for the vocab-split embedding, and an
all-gather of the vocab-split logits, each alpha + ring bytes / link bandwidth. At batch-1 decode
sizes the alpha term (the device table's collective latency) dominates: 161 collectives of ~8 us
add ~1.3 ms to a 70B step on 4 GPUs.

Tokens per round E(a, K) come from capped-geometric acceptance with per-token rate a. The SSD
round is p*max(T_v, T_tree) + (1-p)*(T_v + T_backup) + exchange (Theorem 7 in seconds), with
p = p_row^B because a synchronous batch waits for the backup when any row misses; the neural
backup drafts from the right prefix, so E_hit = E_miss = E(a, K).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from ssd_jax.config import ModelConfig
from ssd_jax.plan import memory
from ssd_jax.plan.devices import Device
from ssd_jax.plan.layout import Setup


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """Stated inputs of the speed model (defaults: greedy 70B/1B anchors of the paper)."""

    acceptance: float = 0.8  # per-token acceptance a
    hit_rate: float = 0.88  # per-row speculation-cache hit rate (~0.88 measured at T=0)
    efficiency: float = 1.0  # fraction of peak HBM bandwidth and FLOP/s attained
    overhead_s: float = 0.0  # fixed host / launch cost per forward
    collective_s: float | None = None  # small-collective latency; None: the device table's

    def __post_init__(self):
        if not 0 <= self.acceptance <= 1 or not 0 <= self.hit_rate <= 1:
            raise ValueError(f"acceptance={self.acceptance} and hit_rate={self.hit_rate} are "
                             "probabilities: keep them in [0, 1]")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency={self.efficiency} must lie in (0, 1]")


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per round per row] = sum_k P(k) (k+1) under capped-geometric acceptance."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def _comm(c: ModelConfig, dev: Device, tp: int, rows: int, alpha: float) -> float:
    if tp == 1:
        return 0.0
    hidden = rows * c.hidden_size * jnp.dtype(c.dtype).itemsize
    all_reduce = alpha + 2 * (tp - 1) / tp * hidden / dev.link_bw
    t = 2 * c.num_layers * all_reduce
    if c.vocab_size % tp == 0:  # vocab-split embedding and LM head
        t += all_reduce + alpha + (tp - 1) / tp * rows * c.vocab_size * 4 / dev.link_bw
    return t


def forward_time(c: ModelConfig, dev: Device, a: Assumptions, *, tp: int, batch: int,
                 tokens: int, context: int, extra_bytes: int = 0) -> float:
    """Seconds for one forward of `tokens` new tokens per row over a `context`-token prefix."""
    w = memory.weight_bytes(c, tp)
    kv_per_token = memory.kv_cache_bytes(c, 1, 1, tp)
    heads = c.num_heads // tp if c.num_heads % tp == 0 else c.num_heads
    hbm = w.total - w.embed_table + batch * (context + tokens) * kv_per_token + extra_bytes
    flops = (2 * w.matmul_params * batch * tokens
             + 4 * c.num_layers * heads * c.head_dim * batch * tokens * context)
    roof = max(hbm / (dev.hbm_bw * a.efficiency), flops / (dev.peak_flops * a.efficiency))
    alpha = dev.collective_s if a.collective_s is None else a.collective_s
    return roof + a.overhead_s + _comm(c, dev, tp, batch * tokens, alpha)


@dataclass(frozen=True)
class Prediction:
    mode: str
    k: int  # lookahead (0 for AR)
    tokens_per_round: float  # over the whole batch
    round_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens_per_round / self.round_s


def predict(s: Setup, a: Assumptions) -> tuple[list[Prediction], dict[str, float]]:
    """AR, SD and SSD predictions plus the phase times (seconds) they are built from."""
    dev, B, S = s.device, s.batch, s.context
    fwd = lambda c, tp, t, extra=0: forward_time(  # noqa: E731
        c, dev, a, tp=tp, batch=B, tokens=t, context=S, extra_bytes=extra)
    tp_t, tp_d, K, M = s.target_devices, s.draft_devices, s.k, s.budget
    ph: dict[str, float] = {}
    ph["ar_step"] = fwd(s.target, tp_t, 1)
    # SD: the draft is replicated on the target devices (TP 1, no collectives), then verify.
    ph["sd_draft_step"] = fwd(s.draft, 1, 1)
    ph["sd_verify"] = fwd(s.target, tp_t, s.sd_k + 1)
    # SSD: verify K+1 on the target mesh while the draft mesh runs glue + K tree steps of M
    # branches per row (each step also reads the growing tree K/V and writes q' when sampling).
    # The glue feeds one token: the rest was fed when the speculation was decoded (glue.py).
    ph["verify"] = fwd(s.target, tp_t, K + 1)
    q_write = B * M * s.draft.vocab_size * 4 if s.sampling else 0
    tree_kv = memory.tree_kv_bytes(s.draft, B, M, K, tp_d)
    ph["tree"] = fwd(s.draft, tp_d, 1) + K * fwd(s.draft, tp_d, M, tree_kv + q_write)
    ph["backup"] = K * fwd(s.draft, tp_d, 1)
    alpha = dev.collective_s if a.collective_s is None else a.collective_s
    spec = memory.speculation_bytes(B, K, s.draft.vocab_size, s.sampling)
    ph["exchange"] = 2 * alpha + spec / dev.link_bw
    p = a.hit_rate ** B
    ph["all_hit"] = p
    ssd_round = (p * max(ph["verify"], ph["tree"]) + (1 - p) * (ph["verify"] + ph["backup"])
                 + ph["exchange"])
    return [
        Prediction("AR", 0, B, ph["ar_step"]),
        Prediction("SD", s.sd_k, B * expected_tokens(a.acceptance, s.sd_k),
                   s.sd_k * ph["sd_draft_step"] + ph["sd_verify"]),
        Prediction("SSD", K, B * expected_tokens(a.acceptance, K), ssd_round),
    ], ph
