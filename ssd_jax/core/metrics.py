"""Counters and timers every decode mode reports (prefill is timed apart from decode), in one
type whichever driver ran the loop (a worker process sends `to_dict()`, rebuilt here)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np


@dataclass
class SSDStats:
    """SSD counters, kept by each side for what it sees: the target records hits and accept
    lengths of the rounds it verified, the draft side its build/select time and fan-out fit.
    Times are summed only when phases are timed (RunMetrics.sync_phases or a worker process)."""

    k: int = 0
    rounds: int = 0  # row-rounds of live rows
    hits: int = 0
    all_hit_rounds: int = 0
    batch_rounds: int = 0
    accept_hist_hit: list = None  # rounds with k accepted, after a cache hit
    accept_hist_miss: list = None  # ... after a miss (the backup's speculation)
    build_s: float = 0.0  # draft: glue + fork + tree decode, summed over rounds
    select_s: float = 0.0  # draft: lookup or backup
    build_rounds: list = None  # draft: each round's build time (autotune.per_round)
    exposed_s: float = 0.0  # target: waiting for the next speculation after its verification
    # ... split by what came: every live row's speculation a hit (the exchanges and the lookup
    # only) or some row's a backup's (the backup's draft steps on the critical path)
    exposed_hit_s: float = 0.0
    exposed_hit_rounds: int = 0
    exposed_miss_s: float = 0.0
    exposed_miss_rounds: int = 0
    backup: str = "neural"  # the backup in use (backup="auto" re-decides every chunk)
    fanout: list | None = None  # the draft's last F_0..F_K
    a: float | None = None  # the fan-out's fitted per-token acceptance
    r: float | None = None  # and its power-law exponent of misses vs F

    def __post_init__(self):
        for name in ("accept_hist_hit", "accept_hist_miss"):
            if getattr(self, name) is None:
                setattr(self, name, [0] * (self.k + 1))
        if self.build_rounds is None:
            self.build_rounds = []

    def record(self, n, hit, done, rows: int) -> np.ndarray:
        """Count one round of the real rows (the first `rows`); returns the live-row mask."""
        live = ~np.asarray(done)[:rows]
        n, hit = np.asarray(n)[:rows], np.asarray(hit)[:rows]
        self.rounds += int(live.sum())
        self.hits += int((hit & live).sum())
        if live.any():
            self.batch_rounds += 1
            self.all_hit_rounds += int(hit[live].all())
        for hist, mask in ((self.accept_hist_hit, live & hit), (self.accept_hist_miss, live & ~hit)):
            for k in n[mask]:
                hist[int(k)] += 1
        return live

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.rounds, 1)

    @property
    def all_hit_rate(self) -> float:
        return self.all_hit_rounds / max(self.batch_rounds, 1)

    @property
    def tokens_after_hit(self) -> float | None:
        """Mean tokens a row emits in a round whose speculation was a hit."""
        h = np.asarray(self.accept_hist_hit)
        return float((h * (np.arange(len(h)) + 1)).sum() / h.sum()) if h.sum() else None

    def take_draft_side(self, draft: "SSDStats") -> None:
        """The draft side's figures, into the target side's record of the run."""
        self.build_s, self.select_s, self.backup = draft.build_s, draft.select_s, draft.backup
        self.build_rounds = draft.build_rounds
        self.fanout, self.a, self.r = draft.fanout, draft.a, draft.r

    def to_dict(self) -> dict:
        return dict(asdict(self), hit_rate=self.hit_rate, all_hit_rate=self.all_hit_rate)

    @classmethod
    def from_dict(cls, d: dict) -> "SSDStats":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class RunMetrics:
    mode: str
    batch: int
    ttft_s: float = 0.0  # prompt in -> first token on the host
    decode_s: float = 0.0  # after the first token, until the last one is on the host
    decode_steps: int = 0  # target forwards after prefill (AR: one per token; SD/SSD: rounds)
    new_tokens: int = 0  # tokens kept, all rows, first token included
    accept_hist: list[int] = field(default_factory=list)  # SD/SSD: rounds with k accepted
    k: int = 0  # SD/SSD lookahead
    sync_phases: bool = False  # block after draft and verify to time them apart
    draft_s: float = 0.0  # time in drafting (only with sync_phases)
    verify_s: float = 0.0  # time in target verification (only with sync_phases)
    verify_rounds: list = field(default_factory=list)  # SD/SSD, timed: each round's verify
    draft_rounds: list = field(default_factory=list)  # SD, timed: each round's K draft steps
    # AR: each chunk's seconds per step (the host reads sync_every steps at a time)
    step_chunks: list = field(default_factory=list)
    ssd: SSDStats | None = None  # SSD: hit rates, accept histograms on hits / misses, phases
    settings: dict | None = None  # SD/SSD: K, budget, backup...; when chosen, the prediction

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by the decode phase (the first token belongs to prefill)."""
        return max(self.new_tokens - self.batch, 0)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tpot_ms(self) -> float:
        """Time per output token of one row (decode only)."""
        per_row = self.decode_tokens / max(self.batch, 1)
        return 1e3 * self.decode_s / per_row if per_row else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens a row emits per target forward (AR: 1)."""
        rounds = sum(self.accept_hist)
        if not rounds:
            return 1.0
        return sum((k + 1) * c for k, c in enumerate(self.accept_hist)) / rounds

    @property
    def acceptance(self) -> float:
        """Per-token acceptance estimate: accepted draft tokens / proposed draft tokens."""
        rounds = sum(self.accept_hist)
        if not rounds or not self.k:
            return 0.0
        return sum(k * c for k, c in enumerate(self.accept_hist)) / (rounds * self.k)

    def to_dict(self) -> dict:
        d = asdict(replace(self, ssd=None))
        if self.ssd is not None:
            d["ssd"] = self.ssd.to_dict()
        d.update(decode_tokens=self.decode_tokens, decode_tok_s=self.decode_tok_s,
                 tpot_ms=self.tpot_ms, tokens_per_round=self.tokens_per_round,
                 acceptance=self.acceptance)
        return d


def metrics_from_dict(d: dict) -> RunMetrics:
    """Rebuild RunMetrics sent by a worker process (derived fields are recomputed)."""
    names = {f.name for f in fields(RunMetrics)}
    m = RunMetrics(**{k: v for k, v in d.items() if k in names and k != "ssd"})
    if d.get("ssd") is not None:
        m.ssd = SSDStats.from_dict(d["ssd"])
    return m
