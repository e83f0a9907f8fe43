"""Counters and timers every decode mode reports (prefill is timed apart from decode)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace


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
    ssd: object = None  # SSD: ssd.SSDStats (hit rates, accept histograms on hits / misses)
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
        m.ssd = _Stats(**d["ssd"])
    return m


class _Stats:
    """SSD statistics received from a worker: attributes, plus to_dict() of their current values."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return dict(self.__dict__)
