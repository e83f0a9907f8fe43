"""Timed runs of one (mode, suite, configuration) cell through the ssd_jax engine.

Accounting: decode throughput is (sum of decode tokens) / (sum of decode seconds) over all
batches of the cell; the first token of every row and the prefill are excluded (they are TTFT).
Every distinct compiled shape is warmed up before timing (compile time is reported apart).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

PROBES = 3  # k=auto: untimed probes of a cell's workload, at most (Cells.probe)


@dataclass(frozen=True)
class Point:
    """One configuration of the sweep. Fields a mode ignores are None in its cells."""

    k: int | None
    budget: int | None  # SSD branches per row M (0 = the engine's default 2(K+1))
    fanout: str | None
    c: float | None
    backup: str | None
    temperature: float
    top_p: float
    batch: int
    # --ar-fallback: an automatic cell pinned to its choice, whose calls the engine decodes
    # with AR where it predicts that choice slower than AR, call by call
    # (SpecConfig.ar_fallback)
    ar_fallback: bool = False

    def for_mode(self, mode: str) -> "Point":
        if mode in ("ar", "hf-ar"):
            return dataclasses.replace(self, k=None, budget=None, fanout=None, c=None, backup=None,
                                       ar_fallback=False)
        if mode in ("sd", "hf-assisted"):
            return dataclasses.replace(self, budget=None, fanout=None, c=None, backup=None)
        return self

    def rows(self) -> int:
        """The padded batch its calls run at (the engine's batch bucket, a power of two):
        the key of their step costs."""
        return 1 << (self.batch - 1).bit_length()

    def spec(self):
        from ssd_jax.config import SpecConfig
        kw = {f: getattr(self, f) for f in ("k", "budget", "fanout", "c", "backup")
              if getattr(self, f) is not None}
        return SpecConfig(**kw, ar_fallback=self.ar_fallback)


def encode(llm, prompts, chat: bool = True) -> tuple[list[list[int]], str]:
    """Token ids of the prompts (chat template when the tokenizer has one) and how they were
    made. A model without a tokenizer (tiny test models) gets bytes folded into its vocab."""
    tok = llm.tokenizer
    if tok is None:
        V = llm.config.vocab_size
        return [[3 + b % (V - 3) for b in p.text.encode()][:48] for p in prompts], "bytes"
    if chat and tok.chat_template:
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}]),
                           add_special_tokens=False) for p in prompts], "chat template"
    return [tok.encode(p.text) for p in prompts], "plain"


def sampling(point: Point, n: int, out_len: int, seed: int, ignore_eos: bool):
    from ssd_jax import SamplingParams
    return [SamplingParams(temperature=point.temperature, top_p=point.top_p,
                           max_new_tokens=out_len, seed=seed * 100003 + i, ignore_eos=ignore_eos)
            for i in range(n)]


class Cells:
    """Runs cells on one LLM; remembers which shapes are compiled."""

    def __init__(self, llm, *, out_len: int, seed: int, ignore_eos: bool, progress: bool,
                 ar_fallback: bool = False):
        self.llm, self.out_len, self.seed, self.ignore_eos = llm, out_len, seed, ignore_eos
        self.progress, self.ar_fallback = progress, ar_fallback
        self.warm: set = set()

    def _batches(self, ids, point):
        return [list(range(i, min(i + point.batch, len(ids))))
                for i in range(0, len(ids), point.batch)]

    def driver(self, mode: str) -> str:
        f = getattr(self.llm, "driver", None)
        return f(mode) if callable(f) else "single"

    def warmup(self, mode: str, point: Point, ids, params) -> float:
        t0 = time.perf_counter()
        # A cell that may fall back compiles both of its programs: its speculative one
        # (ar_fallback off, or the engine might run AR) and AR's. The bench runs every mode
        # with one driver, so AR's compile is the one its calls that fall back run.
        plans = [(mode, dataclasses.replace(point, ar_fallback=False))]
        if point.ar_fallback:
            plans.append(("ar", point.for_mode("ar")))
        for b in self._batches(ids, point):
            args = ([ids[i] for i in b], [params[i] for i in b])
            for m, p in plans:
                kw = dict(mode=m, chat=False, spec=p.spec())
                key = (m, p.for_mode(m), params[0].temperature == 0,
                       self.llm.shapes(*args, **kw))
                if key in self.warm:
                    continue
                if self.driver(m) == "processes" or m == "ar":
                    # A full generate: LLM.warmup stops after the first chunk, and closing
                    # the worker stream early stops the worker pool (its programs would
                    # recompile); an AR answer teaches its steps' decode-time multiple (a
                    # first chunk teaches nothing: in one process on both cores, AR was
                    # predicted from start-up timing alone, 26% below what it ran).
                    self.llm.generate(*args, **kw)
                else:
                    self.llm.warmup(*args, **kw)
                self.warm.add(key)
        return time.perf_counter() - t0

    def _generate(self, mode, point, ids, params, agg, bar=None, sync_phases: bool = False):
        for b in self._batches(ids, point):
            self._batch(mode, point, ids, params, b, agg, bar, sync_phases)

    def _batch(self, mode, point, ids, params, rows, agg, bar=None, sync_phases: bool = False):
        # Settings go with each call, so one loaded LLM serves every point of the sweep.
        agg.add(rows, self.llm.generate([ids[i] for i in rows], [params[i] for i in rows],
                                        mode=mode, chat=False, spec=point.spec(),
                                        sync_phases=sync_phases))
        if bar is not None:
            bar.update(len(rows))

    def pin(self, mode: str, point: Point) -> tuple[Point, dict | None]:
        """k=auto: the engine's choice for this cell, made once and pinned for all its calls
        (left free, it follows the acceptance learnt call by call and K could change inside a
        cell). Returns the pinned point and the choice's description."""
        if point.k is not None or mode == "ar":
            return point, None
        spec, settings = self.llm.settings(mode, rows=point.batch, spec=point.spec(),
                                           sampling_params=self._call(point))
        # --ar-fallback: what SpecConfig(ar_fallback=True) gives a user, call by call with what
        # the store holds then (pinned, the choice is predicted before the AR cell's answers
        # teach AR's speed: the first run pinned cells against an AR prediction 15% low); K
        # stays pinned, so the speculative calls' rounds add up and compile once.
        return dataclasses.replace(point, k=spec.k, budget=spec.budget, backup=spec.backup,
                                   fanout=spec.fanout, c=spec.c,
                                   ar_fallback=self.ar_fallback), settings

    def _call(self, point: Point):
        """A cell's call as settings() sees it: its answers' length (the model counts the
        rounds an answer of out_len tokens takes) and, sampled, its settings (Saguaro's C is
        chosen for them)."""
        from ssd_jax import SamplingParams
        return SamplingParams(temperature=point.temperature, top_p=point.top_p, seed=0,
                              max_new_tokens=self.out_len)

    def predicted(self, mode: str, point: Point, chosen: dict | None) -> float | None:
        """The speed model's tok/s for a pinned cell, fixed before it is timed and after its
        untimed warm-up (what the store has learnt so far; None where it has no step costs for
        the cell): an automatic cell's choice's, AR's from the target's step (measuring step
        costs if none are stored; an AR warm-up answer teaches their decode-time multiple),
        given settings' at them (greedy cells only)."""
        if chosen is not None:  # a cell that may fall back expects the faster of the two
            p = chosen["predicted"]
            return max(p[mode], p["ar"]) if point.ar_fallback else p[mode]
        if mode == "ar":
            return self.llm.core.ar_prediction(point.rows(), measure=True,
                                               sampled=point.temperature > 0)
        if point.temperature > 0:
            return None
        return (self.llm.settings(mode, rows=point.batch, spec=point.spec(),
                                  sampling_params=self._call(point))[1] or {}).get(
            "predicted_tok_s")

    def probe(self, mode: str, point: Point, ids, params) -> None:
        """k=auto: let the engine see this workload before it chooses, as a serving engine has
        seen the requests it serves (the acceptance it learns moves with the kind of prompt;
        chosen with another suite's, code got K and M fit for chat). Untimed: every prompt's
        whole answer, as the cell will ask for it. Shorter probes misled the choice: whole
        answers to the first two prompts read acceptance 0.94 on code where the suite's is
        0.79-0.85, and the first 32 tokens of every answer read 0.90 where whole ones give
        0.86-0.87 (the start of an answer is easier to guess). What earlier runs taught
        (another suite, the warm-up's first prompt) is dropped first, so the choice sees the
        whole workload's acceptance, every prompt by its length.
        What a probe teaches at one cell carries to another only roughly (the hit model's r,
        the overlap of the two sides): on code a probe taught r = 1.12, promising the cell it
        then chose a hit rate of 0.90 (+18% tok/s); that cell hit 0.81, and its own answers
        taught r = 0.80. So a probe that moves the choice runs again at the new one, up to
        PROBES times in all, and the cell is timed where the last probe ran (unless the
        choice still moved).
        In one process (the single driver) the probe's phases are timed (sync_phases) so its
        rounds teach the step costs' multiples, as worker processes' always do: untimed, SD
        on both cores was predicted from start-up timing alone, 16% below what it ran."""
        if point.k is not None or mode == "ar":
            return
        probe, _ = self.pin(mode, point)
        # The step costs' multiples are this hour's too: the probe's answers alone set them
        # (Engine.forget_timings), so the cell's prediction is not half an older hour's.
        self.llm.core.forget_timings(mode, point.rows(), sampled=point.temperature > 0)
        for _ in range(PROBES):
            self.llm.core.forget_acceptance()
            # Probes speculate, also where the choice falls back: they teach the acceptance
            # that choice is made from.
            speculate = dataclasses.replace(probe, ar_fallback=False).spec()
            for b in self._batches(ids, point):
                self.llm.generate([ids[i] for i in b], [params[i] for i in b], mode=mode,
                                  chat=False, spec=speculate,
                                  sync_phases=self.driver(mode) == "single")
            chosen, _ = self.pin(mode, point)
            if chosen == probe:
                return
            probe = chosen

    def ar_costs(self, point: Point) -> None:
        """AR's step costs measured (where none are stored) before its warm-up, whose answer
        then teaches their decode-time multiple afresh, as a probe does for SD and SSD.
        Measured after it, where the prediction needed them, they left that answer nothing to
        compare with, and AR was predicted from start-up timings alone: +12-15% on session
        48's host (decode steps 254 ms a token, 222 at start-up)."""
        rows, sampled = point.rows(), point.temperature > 0
        self.llm.core.ar_prediction(rows, measure=True, sampled=sampled)
        self.llm.core.forget_timings("ar", rows, sampled=sampled)

    def prepare(self, mode: str, suite: str, point: Point, ids) -> "Pending":
        """A cell ready to time: probed and pinned (k=auto), its shapes compiled."""
        params = sampling(point, len(ids), self.out_len, self.seed, self.ignore_eos)
        if mode == "ar":
            self.ar_costs(point)
        self.probe(mode, point, ids, params)
        point, chosen = self.pin(mode, point)
        warm_s = self.warmup(mode, point, ids, params)
        agg = Agg(point.for_mode(mode), self.driver(mode))
        agg.chosen = chosen
        agg.predicted = self.predicted(mode, point, chosen)
        return Pending(mode, suite, point, ids, params, agg, warm_s)

    def run(self, mode: str, suite: str, point: Point, ids, desc: str = "") -> dict:
        p = self.prepare(mode, suite, point, ids)
        bar = _bar(len(ids), desc if self.progress else "")
        self._generate(mode, p.point, ids, p.params, p.agg, bar)
        bar.close()
        return p.agg.cell(mode, suite, p.warm_s)

    def run_interleaved(self, jobs: list[tuple[str, str, Point, list]], bar=None) -> list[dict]:
        """The cells of `jobs` ((mode, suite, point, ids) each) timed batch by batch in turn:
        batch 1 of every cell, then batch 2, ..., the order rotating by one each time. Every
        cell is probed, pinned and compiled first. A machine whose speed drifts over the run
        (these VMs: 10-25% within an hour; one setting ran 15% apart in two sweeps) then
        slows every cell alike, and the cells' ratios are the machine's, not the hour's."""
        pending = [self.prepare(*job) for job in jobs]
        batches = [self._batches(p.ids, p.point) for p in pending]
        for j in range(max(len(b) for b in batches)):
            for n in range(len(pending)):
                i = (j + n) % len(pending)
                p = pending[i]
                if j < len(batches[i]):
                    self._batch(p.mode, p.point, p.ids, p.params, batches[i][j], p.agg, bar)
        return [p.agg.cell(p.mode, p.suite, p.warm_s) for p in pending]

    def calibrate(self, mode: str, point: Point, ids) -> dict | None:
        """Per-round phase times with the engine blocking between phases, for the speed model
        only (throughput is measured without the blocking). The processes driver always times
        its phases, so its cells carry them already and need no separate pass."""
        params = sampling(point, len(ids), self.out_len, self.seed, self.ignore_eos)
        point, _ = self.pin(mode, point)
        point = dataclasses.replace(point, ar_fallback=False)  # the rounds of its choice
        self.warmup(mode, point, ids, params)
        agg = Agg(point.for_mode(mode), self.driver(mode))
        self._generate(mode, point, ids, params, agg, sync_phases=True)
        return agg.phases()


@dataclass
class Pending:
    """A prepared cell: what Cells.prepare resolved, and the sums its timed batches add to."""

    mode: str
    suite: str
    point: Point  # pinned
    ids: list
    params: list
    agg: "Agg"
    warm_s: float


class Agg:
    """Sums a cell's batches."""

    def __init__(self, point: Point, driver: str):
        self.point, self.driver = point, driver
        self.outputs: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}
        self.decode_tokens = self.decode_s = self.row_tokens = self.steps = 0
        self.verify = self.draft = self.build = self.select = self.exposed = 0.0
        self.miss_rounds = 0.0
        self.exposed_split = [0.0, 0, 0.0, 0]  # target's wait: hit s, rounds, miss s, rounds
        self.ttft, self.hist = [], None
        self.settings: dict | None = None  # what the engine ran
        self.chosen: dict | None = None  # k=auto: the engine's choice, pinned for the cell
        self.predicted: float | None = None  # the speed model's tok/s, before timing
        self.hit = self.miss = None
        self.all_hit_w = 0.0
        self.ar_answers = 0  # --ar-fallback: answers the engine decoded with AR
        self.calls: list[dict] = []  # --ar-fallback: each call as it ran

    def add(self, rows, outs):
        m = outs[0].metrics
        for i, o in zip(rows, outs):
            self.outputs[i], self.finish[i] = o.token_ids, o.finish_reason
        self.decode_tokens += m.decode_tokens
        self.decode_s += m.decode_s
        self.row_tokens += m.decode_tokens / max(len(rows), 1)
        self.ttft.append(m.ttft_s)
        self.settings = m.settings
        if self.point.ar_fallback:  # each call as it ran: AR, or speculating
            self.calls.append(dict(mode=m.mode, k=m.k, answers=len(rows),
                                   decode_tok_s=m.decode_tok_s, accept_hist=m.accept_hist,
                                   hit_rate=m.ssd and m.ssd.hit_rate,
                                   predicted=(m.settings or {}).get("predicted")))
            if m.mode == "ar" and (m.settings or {}).get("ar_fallback"):
                # Its steps are AR's: the cell's rounds, acceptance and phases are those of
                # the calls that speculated.
                self.ar_answers += len(rows)
                return
        self.steps += m.decode_steps
        self.verify += m.verify_s
        self.draft += m.draft_s
        if m.accept_hist:
            self.hist = _acc(self.hist, m.accept_hist)
        if m.ssd is not None:
            s = m.ssd.to_dict()
            self.hit = _acc(self.hit, s["accept_hist_hit"])
            self.miss = _acc(self.miss, s["accept_hist_miss"])
            self.all_hit_w += s["all_hit_rate"] * m.decode_steps
            self.build += s["build_s"]
            self.select += s["select_s"]
            self.exposed += s["exposed_s"]
            for i, name in enumerate(("exposed_hit_s", "exposed_hit_rounds", "exposed_miss_s",
                                      "exposed_miss_rounds")):
                self.exposed_split[i] += s.get(name, 0)
            self.miss_rounds += (1 - s["all_hit_rate"]) * m.decode_steps

    def phases(self) -> dict | None:
        """Seconds per round. t_exposed: what the target waits for the next speculation after
        its verification (single driver, blocking: build + select in series; processes driver:
        the overlap's remainder). t_backup_est: select time attributed to rounds with a miss
        (the neural backup runs only then). t_exposed_hit / t_exposed_miss: the target's wait
        per round that all-hit rounds / rounds with a miss."""
        if not self.steps or self.verify <= 0:
            return None
        out = dict(rounds=int(self.steps), t_verify=self.verify / self.steps)
        if self.hit is None:
            out["t_draft"] = self.draft / self.steps
        else:
            out.update(t_build=self.build / self.steps, t_exposed=self.exposed / self.steps,
                       # A draft process's select time includes its wait for the outcome:
                       # there the target's wait is the measure of the backup's cost.
                       t_backup_est=(self.exposed if self.driver == "processes" else self.select)
                       / max(self.miss_rounds, 1.0))
            hit_s, hit_n, miss_s, miss_n = self.exposed_split
            if hit_n + miss_n:
                out.update(t_exposed_hit=hit_s / max(hit_n, 1),
                           t_exposed_miss=miss_s / max(miss_n, 1))
        return out

    def cell(self, mode: str, suite: str, warm_s: float) -> dict:
        n = len(self.outputs)
        rounds = sum(self.hist) if self.hist is not None else 0
        ssd = None
        if self.hit is not None:
            h, mi = sum(self.hit), sum(self.miss)
            ssd = dict(hit_rate=h / max(h + mi, 1), all_hit_rate=self.all_hit_w / max(self.steps, 1),
                       accept_hist_hit=self.hit.tolist(), accept_hist_miss=self.miss.tolist())
        point = dataclasses.asdict(self.point)  # pinned: the chosen K, M, backup
        return dict(
            mode=mode, suite=suite, **point, driver=self.driver,
            settings=self.chosen or self.settings, automatic=self.chosen is not None,
            predicted_tok_s=self.predicted,
            num_prompts=n, decode_tokens=int(self.decode_tokens), decode_s=self.decode_s,
            decode_tok_s=self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0,
            ttft_ms=1e3 * float(np.mean(self.ttft)),
            tpot_ms=1e3 * self.decode_s / self.row_tokens if self.row_tokens else 0.0,
            rounds=int(self.steps),
            tokens_per_round=(sum((k + 1) * c for k, c in enumerate(self.hist)) / rounds
                              if rounds else 1.0),
            acceptance=(sum(k * c for k, c in enumerate(self.hist)) / (rounds * (len(self.hist) - 1))
                        if rounds and len(self.hist) > 1 else None),
            accept_hist=None if self.hist is None else self.hist.tolist(), ssd=ssd,
            phases=self.phases() if mode != "ar" else None,  # speculative calls' rounds
            ar_fallback_answers=self.ar_answers if self.point.ar_fallback else None,
            ar_fallback_calls=self.calls if self.point.ar_fallback else None,
            warmup_s=warm_s, finish=[self.finish[i] for i in range(n)],
            outputs=[self.outputs[i] for i in range(n)])


def _acc(total, hist):
    h = np.asarray(hist, np.int64)
    return h if total is None else total + h


def _bar(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="prompt", leave=False, disable=not desc)
