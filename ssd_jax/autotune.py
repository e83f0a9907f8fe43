"""Automatic speculation settings: measured step costs through the speed model pick K, the
branch budget M (and so its split over accept lengths) and the backup.

Costs are measured once per (machine, pair, batch, dtype), on the devices each side decodes on
(the pinned worker cores on a CPU, so draft and target slow each other as they will in the
run), and cached as JSON beside the models:
  target(T): the target scoring T new tokens per row after a prefix (T = 1 .. K_MAX + 1);
  draft(T):  the draft's forward of T new tokens per row (the glue scores K+1, a tree step M).
Acceptance a and the hit model's miss exponent r come from this pair's earlier runs (r from
greedy SSD runs' hit rates, miss_exponent), stored in the same file; priors until then. SSD
runs also say how much slower verification and the build run beside each other than alone
(StepCosts.verify_overlap, build_overlap), SD runs how much more a round's drafting costs than
K draft(1) (sd_draft_scale), AR and SD runs how much slower or faster the target's steps run in
a decode than timed at start-up (target_scale, per token count); all kept with the step costs.

For each (K, M), with P(k) the capped-geometric accept-length law in a and F the engine's
theorem fan-out of M over the K+1 outcomes (fanout.py):
  hit after k < K rejections-at-k: 1 - (F_k + 1)^-r (the recovery token is never the draft's
  top-1, so F_k forks cover ranks 2..F_k+1); after all K accepted: 1 - (1 - a) F_K^-r
  p = sum_k P(k) hit(k),  E = sum_k P(k) (k + 1) tokens per round
  t_v = target(K+1) verify_overlap,  t_build = (glue + K draft(M)) build_overlap,
  t_backup = K draft(1) sd_draft_scale
  glue = draft(1) when the speculation came out of the draft (a hit, or the neural backup:
  core/glue.py), draft(K+1) after fast-backup guesses (with probability 1 - p_B)
  SSD tok/s = B E / (t_v [p_B w + (1 - p_B)(1 + t_backup / t_v)])  (speed.py), where a hit
  round lasts w = E[max(1, t_build / t_v + noise)] verifications, the noise the rounds' spread
  (StepCosts.round_spread; with none, w = max(1, t_build / t_v) as the paper has it)
  SD tok/s  = B E / (K draft(1) sd_draft_scale + target_run(K+1)),  AR tok/s = B / target_run(1)
  with target_run(T) = target(T) target_scale(T) (1 where no run has taught it)
  and, for a call of known answer length L, SD and SSD by (L / E) / rounds_per_answer: the
  last round's cut tokens and the rounds a sync_every chunk runs past an answer's end
A sampled SSD run replaces the hit model (and scales a) with the pair's measured response to
Saguaro's C (saguaro_curve.py), and C joins K, M and the backup in the search.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ssd_jax.core.fanout import FanoutModel, geometric_probs
from ssd_jax.core.speed import ssd_speedup

# The largest K the speed model considers. K = 5 was tried on the Qwen pair (code suite, bf16
# draft, interleaved with K = 4: results/k5_ab): the kernel scores 6 tokens in one pass over
# the weights (cpu_matmul.cc) and start-up timing put 6 tokens at 1.03x 5, but in a decode
# SD's 6-token verification ran 1.15x its 5-token one, and both SD (9.9 against 10.5 tok/s)
# and SSD (11.4 against 11.9) were slower at K = 5. A caller's explicit K is not capped.
K_MAX = 4
M_MAX = 16
TARGET_TOKENS = tuple(range(1, K_MAX + 2))
DRAFT_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
PRIOR_A, PRIOR_R = 0.7, 1.5
# Rounds of evidence (AR: steps) a learnt figure stands for: the acceptance, hit rate and the
# step costs' multiples; about eight 96-token answers at K=3. Within it, runs count by their
# rounds (a pooled mean); past it, older runs fade. Not a fixed weight per run: at 0.6 a
# 96-token answer, the last answer or two set SSD's verify_overlap (1.27 after a probe,
# 1.33-1.37 a few answers later on the same cell).
ACCEPT_WINDOW = 240
FAST_E_MISS = 1.2  # tokens per round after an n-gram guess (rarely accepted)


@dataclass(frozen=True)
class StepCosts:
    target: dict  # T -> seconds (target scores T tokens per row)
    draft: dict  # T -> seconds (draft forward over T tokens per row)
    # SSD's rounds run verification and the cache build at the same time: on a CPU they share
    # memory bandwidth, and each runs slower than the step costs timed at start-up say
    # (per_round has the Qwen pair's figures). Learnt from SSD runs; 1 until then.
    verify_overlap: float = 1.0
    build_overlap: float = 1.0
    # SD's K draft steps in a round against K draft(1): the step costs time a forward alone,
    # a round also samples, checks and dispatches each step. Learnt from SD runs; SSD's neural
    # backup is the same K steps in series, so it scales it too.
    sd_draft_scale: float = 1.0
    # The spread (standard deviation) of a round's build minus its verification, as a fraction
    # of the verification. A hit round waits for the later of the two, and the mean of the
    # later is more than the later of the means: a build that takes as long as the verification
    # on average exposes ~0.4 spread a round (expected_wait). Learnt from SSD runs; 0 until then.
    round_spread: float = 0.0
    # T -> the target's steps of T tokens in a decode (AR's steps, SD's verification at K =
    # T - 1) against the same forward timed at start-up. 7 timings miss the machine's bursts
    # of interference (this VM's steal time: one answer's steps ran 186-303 ms, median 204,
    # mean ~10% above it) and its drift (the same VM an hour apart: AR 1.12x and SD's K=3
    # verification 1.11x their timed steps in one run, 0.92x and 0.88x in another). Per token
    # count, because each count's timings can land in a spell of their own (one store: target(3)
    # timed 0.350 s, as much as target(4)'s 0.355 and 23% over target(2)'s). Learnt from AR and
    # SD runs; 1 where none has run. SSD's verify_overlap, learnt from its own rounds against
    # target(K+1), holds SSD's.
    target_scale: dict = field(default_factory=dict)

    def target_run(self, t: int) -> float:
        """target(t) as runs have shown a decode's steps of t tokens to cost."""
        return self.target[t] * self.target_scale.get(t, 1.0)

    def draft_at(self, t: int) -> float:
        """Linear between measured token counts (forward cost grows ~linearly in T here)."""
        ts = sorted(self.draft)
        return float(np.interp(t, ts, [self.draft[x] for x in ts]))


@dataclass(frozen=True)
class Choice:
    k: int
    budget: int
    backup: str
    fanout: list  # F_0..F_K
    hit_rate: float  # predicted per-row hit rate
    tokens_per_round: float
    tok_s: dict  # mode -> predicted tok/s (ar, sd, ssd)
    a: float
    r: float
    c: float | None = None  # Saguaro's C, chosen for a sampled SSD run (None: greedy, C = 1)
    # the costs' (verify_overlap, build_overlap, round_spread) it assumed
    overlap: tuple = (1.0, 1.0, 0.0)

    def ar_is_faster(self, mode: str) -> bool:
        """Whether the model predicts plain AR steps faster than `mode` at these settings (a
        pair and workload whose acceptance is too low for speculation to pay on this
        machine)."""
        return self.tok_s[mode] < self.tok_s["ar"]

    def describe(self) -> str:
        saguaro = "" if self.c is None else f", Saguaro C={self.c:g}"
        return (f"K={self.k}, M={self.budget} (fan-out {self.fanout}), backup {self.backup}"
                f"{saguaro}; predicted SSD {self.tok_s['ssd']:.1f} tok/s, SD {self.tok_s['sd']:.1f}, "
                f"AR {self.tok_s['ar']:.1f} (a={self.a:.2f}, hit rate {self.hit_rate:.2f})")


def hit_rate(a: float, r: float, fan: np.ndarray) -> float:
    k = len(fan) - 1
    p_k = geometric_probs(a, k)
    f = np.maximum(np.asarray(fan, np.float64), 0)
    hit = np.where(f > 0, 1 - (f + 1) ** -r, 0.0)
    hit[k] = 1 - (1 - a) * max(f[k], 1) ** -r if f[k] > 0 else 0.0
    return float((p_k * hit).sum())


def _tokens_per_round(a: float, k: int) -> float:
    """E = sum_k P(k) (k + 1) under the capped-geometric accept-length law."""
    return float((geometric_probs(a, k) * (np.arange(k + 1) + 1)).sum())


# Past this many tokens an answer's expected rounds grow by 1/E a token (rounds_per_answer).
RENEWAL_HORIZON = 512


@functools.lru_cache(maxsize=256)
def _rounds_to_emit(a: float, k: int, tokens: int) -> float:
    """Expected rounds until a row has emitted `tokens` tokens, each round emitting n + 1 with
    n capped-geometric in a: R(t) = 1 + sum_n P(n) R(t - n - 1), R(t <= 0) = 0."""
    p = geometric_probs(a, k)
    r = np.zeros(tokens + k + 2)
    for t in range(1, tokens + 1):
        r[t + k + 1] = 1 + float(p @ r[t + k + 1 - np.arange(1, k + 2)])
    return float(r[tokens + k + 1])


def rounds_per_answer(a: float, k: int, tokens: int, sync_every: int = 1) -> float:
    """The rounds one row's answer of `tokens` tokens (after the prefill's) takes: tokens / E
    and then some, because the last round's tokens past the end are cut off, and the host,
    which reads the rounds sync_every at a time, runs a row that ends inside such a chunk to
    the chunk's end ((sync_every - 1) / 2 rounds on average). The Qwen pair's code cells ran
    ~1.1 rounds an answer over tokens / E at sync_every = 2 (session 46's sweep: 23.25
    rounds for 95 tokens at E = 4.30), which the model, counting E tokens a round, missed:
    6 of that sweep's 9 cells ran 2-12% under their prediction (the K = 3 SSD cells, 2-4%
    over it)."""
    head = min(tokens, RENEWAL_HORIZON)
    return (_rounds_to_emit(round(float(a), 4), k, head)
            + (tokens - head) / _tokens_per_round(a, k) + (sync_every - 1) / 2)


def predict(costs: StepCosts, k: int, m: int, *, a: float, r: float, batch: int,
            backup: str = "neural", c: float = 1.0, saguaro=None,
            answer: tuple[int, int] | None = None) -> dict:
    """`saguaro`: a sampled run's saguaro_curve.SaguaroCurve, which gives acceptance and hit
    rate at Saguaro's C (None: greedy, the power-law hit model above). `answer`: (tokens an
    answer decodes after the prefill's, the host's sync_every), to count the rounds an answer
    of that length takes (rounds_per_answer); None: a long answer's E tokens a round. A
    batch's rows are taken as ending together (the longest row's wait is not modelled)."""
    e_sd = _tokens_per_round(a, k)  # SD has no Saguaro: its acceptance is a
    a_sd = a
    fan = FanoutModel("geometric", k, m, a=a, r=r).primary()
    if saguaro is None:
        p = hit_rate(a, r, fan)
    else:  # C moves acceptance, which moves the fan-out: refit it once at the new a
        a = saguaro.acceptance(a, c, fan)
        fan = FanoutModel("geometric", k, m, a=a, r=r).primary()
        p = saguaro.hit_rate(c, fan, a)
    e = _tokens_per_round(a, k)
    t_v = costs.target[k + 1] * costs.verify_overlap
    t_build = build_seconds(costs, k, m, backup, p ** batch) * costs.build_overlap
    t_backup = backup_seconds(costs, k, backup)
    e_miss = e if backup == "neural" else FAST_E_MISS
    speedup = ssd_speedup(p, p ** batch, e, e_miss,
                          expected_wait(t_build / t_v, costs.round_spread), t_backup / t_v)
    sd_short = ssd_short = 1.0  # a short answer's tokens a round against E
    if answer is not None:
        tokens, sync_every = answer
        sd_short = tokens / e_sd / rounds_per_answer(a_sd, k, tokens, sync_every)
        ssd_short = tokens / e / rounds_per_answer(a, k, tokens, sync_every)
    return dict(hit_rate=p, tokens_per_round=e, fanout=[int(x) for x in fan], a=a,
                ssd=batch * speedup / t_v * ssd_short,
                sd=batch * e_sd * sd_short / (k * costs.draft_at(1) * costs.sd_draft_scale
                                              + costs.target_run(k + 1)),
                ar=batch / costs.target_run(1))


def expected_wait(ratio: float, spread: float) -> float:
    """A hit round in verifications: E[max(1, ratio + spread Z)], Z standard normal (the
    build's and the verification's round-to-round variation, as one normal difference)."""
    if spread <= 0:
        return max(1.0, ratio)
    d = (ratio - 1) / spread
    phi = math.exp(-d * d / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + math.erf(d / math.sqrt(2)))
    return 1 + (ratio - 1) * cdf + spread * phi


def backup_seconds(costs: StepCosts, k: int, backup: str) -> float:
    """What the target waits for after a miss: the neural backup's K draft steps in series,
    alone, as SD's drafting runs (so at SD's learnt multiple); the fast backup's guesses are
    free."""
    return k * costs.draft_at(1) * costs.sd_draft_scale if backup == "neural" else 0.0


def exposed_wait(p_all: float, t_v: float, t_build: float, t_backup: float,
                 spread: float) -> float:
    """Seconds per round the target waits after its verification, as predict's round counts
    it: a hit round until the later build ends, a miss round for the backup."""
    return p_all * t_v * (expected_wait(t_build / t_v, spread) - 1) + (1 - p_all) * t_backup


def build_seconds(costs: StepCosts, k: int, m: int, backup: str, p_all: float) -> float:
    """The cache build as the step costs time it: the glue, then K tree steps over M branches.
    The glue's prefix is known (glue.py) after the neural backup or a hit (p_all: the chance
    every row hit)."""
    known = 1.0 if backup == "neural" else p_all
    glue = known * costs.draft_at(1) + (1 - known) * costs.draft_at(k + 1)
    return glue + k * costs.draft_at(m)


def per_round(seconds: Sequence[float]) -> float:
    """The mean of a run's per-round times without its outliers (over 5x the median: a
    compile, a pause). Not the median: rounds run unevenly side by side (SSD's verification
    on the Qwen pair: median 1.03x the step cost alone, mean 1.18-1.33x), and tok/s follows
    the mean."""
    x = np.asarray(seconds, np.float64)
    return float(x[x <= 5 * np.median(x)].mean())


def overlap_of_run(costs: StepCosts, k: int, m: int, backup: str, p_all: float,
                   verify_rounds: Sequence[float], build_rounds: Sequence[float]
                   ) -> tuple[float, float] | None:
    """(verification, build) per round in an SSD run, as multiples of what the step costs
    predict alone (per_round)."""
    if len(verify_rounds) < 8 or len(build_rounds) < 8:
        return None
    v = per_round(verify_rounds) / costs.target[k + 1]
    b = per_round(build_rounds) / build_seconds(costs, k, m, backup, p_all)
    return float(np.clip(v, 0.5, 3.0)), float(np.clip(b, 0.5, 3.0))


def spread_of_run(costs: StepCosts, k: int, backup: str, p_all: float,
                  verify_rounds: Sequence[float], build_rounds: Sequence[float],
                  exposed_per_round: float) -> float | None:
    """The StepCosts.round_spread at which the model's wait per round after verification,
    p_B t_v (w - 1) + (1 - p_B) t_backup (predict, with the run's own verification and build
    per round), is the run's measured one; 0 when the wait is no more than the spread-free
    model's. Fitted to the wait, not read off the rounds' times: the two sides time their
    rounds in separate processes, and a difference of unpaired rounds reads ~2x too wide."""
    if len(verify_rounds) < 8 or len(build_rounds) < 8:
        return None
    v, b = per_round(verify_rounds), per_round(build_rounds)
    t_backup = backup_seconds(costs, k, backup)

    def wait(spread: float) -> float:
        return exposed_wait(p_all, v, b, t_backup, spread)
    if wait(0.0) >= exposed_per_round or p_all <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    if wait(hi) <= exposed_per_round:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if wait(mid) < exposed_per_round else (lo, mid)
    return (lo + hi) / 2


def sd_draft_scale_of_run(costs: StepCosts, k: int, draft_rounds: Sequence[float]
                          ) -> float | None:
    """An SD run's drafting per round as a multiple of K draft(1) (per_round)."""
    if len(draft_rounds) < 8:
        return None
    return float(np.clip(per_round(draft_rounds) / (k * costs.draft_at(1)), 0.5, 3.0))


def target_scale_of_run(costs: StepCosts, tokens: int, step_seconds: Sequence[float]
                        ) -> float | None:
    """A run's target steps scoring `tokens` tokens a row (AR: 1; SD's verification: K+1)
    as a multiple of target(tokens) (per_round)."""
    if len(step_seconds) < 8 or tokens not in costs.target:
        return None
    return float(np.clip(per_round(step_seconds) / costs.target[tokens], 0.5, 3.0))


def miss_exponent(a: float, fan: Sequence[int], hit: float) -> float:
    """The r at which the hit model gives a run's measured hit rate with its fan-out (hit_rate
    rises with r), by bisection in [0.2, 5]."""
    fan = np.asarray(fan, np.int64)
    lo, hi = 0.2, 5.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if hit_rate(a, mid, fan) < hit else (lo, mid)
    return (lo + hi) / 2


def choose(costs: StepCosts, *, a: float = PRIOR_A, r: float = PRIOR_R, batch: int = 1,
           mode: str = "ssd", saguaro=None, c: float | None = None,
           answer: tuple[int, int] | None = None) -> Choice:
    """The (K, M, backup and, with a sampled run's `saguaro` curve, C) with the highest
    predicted tok/s for `mode` ("ssd" or "sd"). `c`: Saguaro's C given by the caller (the
    curve then only predicts acceptance and hit rate at it). `answer`: as predict's."""
    best = None
    k_max = max(t for t in costs.target) - 1
    cs = ((c,) if c is not None else
          saguaro.cs if saguaro is not None and mode == "ssd" else (1.0,))
    for c_try in cs:
        for k in range(1, min(K_MAX, k_max) + 1):
            for m in range(k + 1, min(M_MAX, 4 * (k + 1)) + 1):
                for backup in ("neural", "fast"):
                    pred = predict(costs, k, m, a=a, r=r, batch=batch, backup=backup,
                                   c=c_try, saguaro=saguaro, answer=answer)
                    score = pred[mode]
                    if best is None or score > best[0] + 1e-9:
                        best = (score, k, m, backup, c_try, pred)
                    if mode == "sd":
                        break  # SD has no branches or backup: one M per K
                if mode == "sd":
                    break
    _, k, m, backup, chosen_c, pred = best
    return Choice(k=k, budget=m, backup=backup, fanout=pred["fanout"],
                  hit_rate=pred["hit_rate"], tokens_per_round=pred["tokens_per_round"],
                  tok_s={x: pred[x] for x in ("ar", "sd", "ssd")}, a=a, r=r,
                  c=chosen_c if saguaro is not None and mode == "ssd" else None,
                  overlap=(costs.verify_overlap, costs.build_overlap, costs.round_spread))


def acceptance_from_rounds(hist) -> float | None:
    """The per-token acceptance a whose capped-geometric law gives this accept-length
    histogram's mean (sum_{i=1..K} a^i = mean accepted), by bisection."""
    hist = np.asarray(hist, np.float64)
    if hist.sum() == 0 or len(hist) < 2:
        return None
    k = len(hist) - 1
    mean = float((hist * np.arange(k + 1)).sum() / hist.sum())
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(1, k + 1)) < mean else (lo, mid)
    return float(np.clip((lo + hi) / 2, 0.02, 0.98))


# ------------------------------------------------------------------ measuring
def time_scoring(runner, batch: int, token_counts, *, prefix: int = 128, reps: int = 7) -> dict:
    """Seconds of one forward of T new tokens per row after `prefix` committed slots: the
    median of `reps`, made non-decreasing in T (scoring more tokens never costs less; a dip is
    noise). The median, not the fastest: a run meets the machine's usual interference too. On
    this project's VM a Qwen 1.5B decode step ran 186-303 ms over one answer, median 204, and
    the fastest of 5 had the model's AR 15-28% faster than AR ran (COSTS_METHOD)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from ssd_jax.models.attention import causal_mask
    from ssd_jax.sharding import put
    # Inputs replicated on the runner's mesh explicitly: a pod's group mesh spans processes.
    on = None if runner.mesh is None else NamedSharding(runner.mesh, P())
    cache = runner.new_cache(batch, prefix + max(token_counts) + 1)
    plen = put(np.full((batch,), prefix, np.int32), on)
    out = {}
    for t in sorted(token_counts):
        tokens, pos, mask = put((np.zeros((batch, t), np.int32),
                                 np.broadcast_to(prefix + np.arange(t, dtype=np.int32), (batch, t)),
                                 np.asarray(causal_mask(batch, t))), on)
        times = []
        for i in range(reps + 1):  # the first call compiles
            t0 = time.perf_counter()
            jax.block_until_ready(runner.forward(tokens, pos, cache, plen, mask))
            if i:
                times.append(time.perf_counter() - t0)
        out[int(t)] = max(float(np.median(times)), max(out.values(), default=0.0))
    return out


# ------------------------------------------------------------------ the cache file
# How time_scoring summarises its reps: part of the store's key, so costs measured another
# way (the fastest of 5, before 2026-12-02) are measured afresh rather than mixed in.
COSTS_METHOD = "median-of-7"


def cache_key(target: str, draft: str, batch: int, dtype: str, split: str) -> str:
    """Costs are per machine (its processor model and instruction sets), software (the CPU
    kernel's source too: a new kernel made a 5-token verification ~20% cheaper) and XLA flags
    (the vector width alone moves a decode step by 16%); the device count is in `split`."""
    import jax
    from ssd_jax.compile_cache import cpu_fingerprint
    from ssd_jax.kernels import cpu
    from ssd_jax.xla_cpu import with_device_count
    flags = with_device_count(os.environ.get("XLA_FLAGS", ""), None)
    machine = (f"{platform.machine()} {cpu_fingerprint()} {os.cpu_count()} {jax.__version__}"
               f" {flags} kernel {cpu.build_key()}")
    return hashlib.sha1(f"{machine}|{target}|{draft}|{batch}|{dtype}|{split}|{COSTS_METHOD}"
                        .encode()).hexdigest()[:16]


def store_path(cache_dir: Path | None = None) -> Path:
    """`cache_dir`/autotune.json; without one, $SSD_JAX_TUNE_FILE if set (a test run keeps its
    tiny models' entries out of the user's store, in its subprocesses too), else the model
    cache's."""
    from ssd_jax.loading.packaged import DEFAULT_CACHE
    if cache_dir is None and os.environ.get("SSD_JAX_TUNE_FILE"):
        return Path(os.environ["SSD_JAX_TUNE_FILE"])
    return Path(cache_dir or DEFAULT_CACHE) / "autotune.json"


def pair_key(target: str, draft: str) -> str:
    return f"{target}|{draft}"


def _blend(old: float | None, new: float, weight: float) -> float:
    """A stored figure moved toward a run's by `weight` (the run's value when none is stored)."""
    return new if old is None else (1 - weight) * old + weight * new


def _dict(x) -> dict:
    """A stored mapping, or {} where the store has something else there (an older
    layout)."""
    return x if isinstance(x, dict) else {}


def _pool(entry: dict, name: str, x: float, rounds: int) -> None:
    """entry[name] moved toward a run's `x` by its `rounds` over the rounds held (at most
    ACCEPT_WINDOW, counted in entry["rounds_" + name]) plus its own; with none held, `x`."""
    count = f"rounds_{name}"
    held = min(entry.get(count, 0), ACCEPT_WINDOW)
    entry[name] = _blend(entry.get(name) if held else None, x, rounds / (held + rounds))
    entry[count] = held + rounds


class TuneStore:
    """The JSON file of measured costs and per-pair acceptance."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def _write(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)

    def costs(self, key: str) -> StepCosts | None:
        entry = self._read().get("costs", {}).get(key)
        if entry is None:
            return None
        return StepCosts({int(t): s for t, s in entry["target"].items()},
                         {int(t): s for t, s in entry["draft"].items()},
                         entry.get("verify_overlap", 1.0), entry.get("build_overlap", 1.0),
                         entry.get("sd_draft_scale", 1.0), entry.get("round_spread", 0.0),
                         {int(t): x for t, x in _dict(entry.get("target_scale")).items()
                          if t.isdigit()})  # beside each, its rounds_T

    def save_costs(self, key: str, costs: StepCosts, note: str) -> None:
        data = self._read()
        data.setdefault("costs", {})[key] = dict(asdict(costs), note=note)
        self._write(data)

    def observe_scales(self, key: str, *, rounds: int, **scales: float) -> None:
        """Fold a run's measured multiples of the step costs (StepCosts.verify_overlap,
        build_overlap, sd_draft_scale, round_spread) into the costs stored at `key`, as observe
        folds acceptance: a run of `rounds` rounds weighs rounds over the rounds held (at most
        ACCEPT_WINDOW) plus its own; the first run after the costs were measured stands alone."""
        data = self._read()
        entry = data.get("costs", {}).get(key)
        if entry is None:
            return
        for name, x in scales.items():
            _pool(entry, name, x, rounds)
        self._write(data)

    def observe_target_scale(self, key: str, tokens: int, scale: float, *, rounds: int
                             ) -> None:
        """observe_scales for StepCosts.target_scale at `tokens` tokens a row."""
        data = self._read()
        entry = data.get("costs", {}).get(key)
        if entry is None:
            return
        entry["target_scale"] = _dict(entry.get("target_scale"))
        _pool(entry["target_scale"], str(tokens), scale, rounds)
        self._write(data)

    def saguaro(self, key: str):
        from ssd_jax.saguaro_curve import SaguaroCurve
        entry = self._read().get("saguaro", {}).get(key)
        return None if entry is None else SaguaroCurve.from_dict(entry)

    def save_saguaro(self, key: str, curve) -> None:
        """A newly measured curve: what runs taught the one it replaces goes with it."""
        data = self._read()
        data.setdefault("saguaro", {})[key] = curve.to_dict()
        self._write(data)

    def observe_saguaro_hits(self, key: str, scale: float, *, rounds: int) -> None:
        """Fold a sampled run's hit rate over what the curve at `key` promised it into the
        curve's hit_scale, pooled by rounds as observe pools the acceptance."""
        data = self._read()
        entry = data.get("saguaro", {}).get(key)
        if entry is not None:
            _pool(entry, "hit_scale", scale, rounds)
            self._write(data)

    def acceptance(self, pair: str) -> tuple[float, float]:
        entry = self._read().get("pairs", {}).get(pair, {})
        return entry.get("a", PRIOR_A), entry.get("r", PRIOR_R)

    def observe(self, pair: str, a: float, hit: float | None = None,
                fan: Sequence[int] | None = None, *, rounds: int) -> None:
        """Fold a run of `rounds` rounds into the stored acceptance a (and, from a greedy SSD
        run's steady hit rate `hit` at fan-out `fan`, the pooled hit rate): its weight is its
        rounds over the rounds held (at most ACCEPT_WINDOW) plus its own. After forget(), runs
        pool by their rounds until the window fills; then the last ~ACCEPT_WINDOW rounds
        dominate. Not the last run alone: a weight of 0.6 per 96-token answer made the store
        hold the last two prompts' acceptance (code's prompts run 0.79-0.94 one by one).
        The hit model's r is refitted to the pooled a and hit rate at `fan`, not pooled
        itself: r climbs steeply as a run's hit rate nears 1, so a mean of per-answer r's
        leans on the easiest answers (a probe's eight code answers at K=3, M=8 averaged to
        r = 1.12, promising that cell a hit rate of 0.87; it hit 0.80. Fitted to their pooled
        hits, the same probe promised 0.83)."""
        data = self._read()
        entry = data.setdefault("pairs", {}).setdefault(pair, {})
        _pool(entry, "a", a, rounds)
        if hit is not None:
            _pool(entry, "hit", hit, rounds)
            entry["r"] = miss_exponent(entry["a"], fan, entry["hit"])
        self._write(data)

    def restart_multiples(self, key: str) -> None:
        """Let the next runs' multiples of the step costs at `key` (StepCosts.verify_overlap,
        build_overlap, sd_draft_scale, round_spread, target_scale) stand alone: each figure
        stays as a first guess but holds no rounds, so the next run's lesson replaces it
        rather than pooling with what earlier hours taught (see Engine.forget_timings)."""
        data = self._read()
        entry = data.get("costs", {}).get(key)
        if entry is None:
            return
        for held in (entry, _dict(entry.get("target_scale"))):
            for name in [n for n in held if n.startswith("rounds_")]:
                held[name] = 0
        self._write(data)

    def forget(self, pair: str) -> None:
        """Drop what runs taught about this pair (a, hit rate, r): the next runs stand alone."""
        data = self._read()
        if data.get("pairs", {}).pop(pair, None) is not None:
            self._write(data)
