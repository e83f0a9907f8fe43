"""The engine core behind `LLM`: models (loaded on first use), their runners on the device split,
the driver (this process or pinned worker processes), automatic settings, and the decode loops.

It takes token ids and per-request settings; prompts are `ssd_jax.prompts`' job. Shapes are
bucketed (batch to a power of two, prompts to the prefill bucket, the cache to 256 positions)
so repeated calls reuse compiled programs.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterator

import jax

from ssd_jax import autotune, compile_cache
from ssd_jax.core.batch import Batch, make_batch, padded_shape, round_up
from ssd_jax.core.metrics import RunMetrics
from ssd_jax.core.rounds import DraftSide, TargetSide, ar_loop, sd_loop, ssd_loop, tokens_in
from ssd_jax.core.runner import ModelRunner
from ssd_jax.core.transport import LocalLink
from ssd_jax.draft_vocab import draft_for
from ssd_jax.config import EngineConfig, SamplingParams, SpecConfig
from ssd_jax.loading import describe, load, pair_vocab, vocab_from_extra
from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.models.transformer import Transformer
from ssd_jax.prompts import check_fits
from ssd_jax.sharding import split_devices

log = logging.getLogger(__name__)
STEADY_ROUNDS = 20  # rounds per row before a run's hit rate teaches the hit model's r
# SpecConfig.ar_fallback: AR tokens decoded in place of a speculative mode before one run
# speculates again to refresh the pair's acceptance, at least; and at least PROBE_RATIO times
# the tokens of the last speculative run, so a probe (a whole run, however long) stays a
# fifth of the decoding at most. AR learns nothing of acceptance, so without probes a
# fallback, once taken, would never be left.
PROBE_TOKENS = 256
PROBE_RATIO = 4
Shapes = tuple[int, int, int]  # (padded batch, prompt bucket, cache length)


def _pod_of(split):
    """A split whose meshes span devices of other processes makes this engine one process of a
    pod (runtime/pod.py); None when this process drives both meshes itself."""
    if split is None or jax.process_count() == 1:
        return None
    if all(d.process_index == jax.process_index()
           for m in (split.target, split.draft) for d in m.devices.flat):
        return None
    from ssd_jax.runtime.pod import Pod
    return Pod.of(split, jax.process_index(), jax.process_count())


class Engine:
    """A target (and optionally a draft) with the programs that decode them.

    `model` / `draft` are names, paths or built `Transformer`s (see `LLM`). `config` is the
    EngineConfig, fixed for the engine's life; the SpecConfig comes with every `run`.
    """

    def __init__(self, model: str | Path | Transformer, draft: str | Path | Transformer | None,
                 *, tokenizer: Tokenizer | None, dtype: str, config: EngineConfig,
                 cache_dir: Path | None, progress: bool):
        compile_cache.enable(models=cache_dir)  # a second run of the pair skips its compiles
        # Names/paths let worker processes load the same models (the "processes" driver).
        self.paths = (None if isinstance(model, Transformer) else str(model),
                      None if draft is None or isinstance(draft, Transformer) else str(draft))
        self.dtype, self.cache_dir, self.progress, self.pool = dtype, cache_dir, progress, None
        self.config = config
        # Weights are loaded on first use in this process: with the worker-process driver only
        # the workers hold them, so the caller never keeps a second copy (a 1.5B target is
        # 7 GB in fp32). Config and tokenizer are read now, from metadata alone.
        self._model = self._draft_model = None
        self._draft_head_cut = False
        self._runners: dict[str, ModelRunner] = {}
        if isinstance(model, Transformer):
            self._model, self.tokenizer, self.model_config = model, tokenizer, model.config
            target = (model.config, tokenizer, {})
        else:
            target = describe(model, dtype=dtype, cache_dir=cache_dir)
            self.model_config, self.tokenizer, extra = target
            if vocab_from_extra(extra) is not None:
                raise ValueError(
                    f"{model!r} is a draft with a truncated vocabulary (its ids map to a "
                    "target's): it cannot be the target; use it as a draft, e.g. "
                    f"LLM('smollm2', draft={str(model)!r})")
        self.split = split_devices(*config.mesh) if config.mesh else None
        self.pod = _pod_of(self.split)
        if self.pod is not None and self.pod.is_group_lead:
            # JAX writes compiled programs from process 0 only, and no process of the target
            # group compiles the draft group's: without this a pod (the pinned CPU server's)
            # compiled the draft's programs at every start.
            compile_cache.write_from_any_process()
        self._control = self._watchdog = self._exchange = None
        self._live = None  # the lead's open live batch on a pod (runtime/pod_live.LeadLive)
        if self.pod is not None:
            self._join_pod()
        self.has_draft, self.vocab = draft is not None, None
        if draft is not None:
            if isinstance(draft, Transformer):
                self._draft_model = draft
                described = (draft.config, None, {})
            else:
                described = describe(draft, dtype=dtype, cache_dir=cache_dir)
            self.vocab = pair_vocab(target, described, config.draft_vocab, cache_dir)
        self.last_choice: autotune.Choice | None = None  # automatic settings of the latest run
        self._curve = None  # the latest Saguaro curve (saguaro_curve.py), for learn()
        self._curve_key = None  # its key in the tuning store
        self._logged_choice: autotune.Choice | None = None
        # Modes whose "AR is faster" warning was given: the choice moves with each run's
        # learned acceptance, and a generate of many batches would repeat it every batch.
        self._warned_slow: set[str] = set()
        # ar_fallback, per asked mode: [AR tokens decoded in place of it since its last
        # speculative run, that run's tokens]. Per mode: SD and SSD calls interleaved (a
        # bench, a server with both) would otherwise reset each other's count.
        self._fallback: dict[str, list[int]] = {}

    # ---------------------------------------------------------------- models, loaded on use
    @property
    def model(self) -> Transformer:
        if self._model is None:
            self._model = load(self.paths[0], dtype=self.dtype, cache_dir=self.cache_dir,
                               progress=self.progress)[0]
        return self._model

    def _draft(self) -> Transformer:
        if self._draft_model is None:
            self._draft_model = load(self.paths[1], dtype=self.dtype, cache_dir=self.cache_dir,
                                     progress=self.progress)[0]
        if not self._draft_head_cut:
            self._draft_model, self._draft_head_cut = draft_for(self._draft_model, self.vocab), True
        return self._draft_model

    def _runner(self, role: str, make) -> ModelRunner:
        if role not in self._runners:
            self._runners[role] = make()
        return self._runners[role]

    @property
    def runner(self) -> ModelRunner:
        """The target's programs on the target mesh."""
        return self._runner("target", lambda: ModelRunner(
            self.model, self.split and self.split.target, self.config.cpu_kernels))

    @property
    def draft_runner(self) -> ModelRunner | None:
        """SSD's draft on the draft mesh (None without a draft)."""
        if not self.has_draft:
            return None
        return self._runner("draft", lambda: ModelRunner(
            self._draft(), self.split and self.split.draft, self.config.cpu_kernels,
            self.config.draft_precision))

    @property
    def sd_draft_runner(self) -> ModelRunner:
        """SD's draft shares the target mesh (SD and AR use the target's devices only)."""
        if self.split is None:
            return self.draft_runner
        return self._runner("sd_draft", lambda: ModelRunner(
            self._draft(), self.split.target, self.config.cpu_kernels,
            self.config.draft_precision))

    # ---------------------------------------------------------------- modes and drivers
    def resolve_mode(self, mode: str | None) -> str:
        mode = mode or ("sd" if self.has_draft else "ar")
        if mode not in ("ar", "sd", "ssd"):
            raise ValueError(f"mode={mode!r} is unknown: use 'ar', 'sd' or 'ssd'")
        if mode != "ar" and not self.has_draft:
            raise ValueError(f"mode={mode!r} needs a draft model: LLM(target, draft=...)")
        return mode

    def driver(self, mode: str) -> str:
        """Where a run executes: "single" (this process), "processes" (pinned workers) or
        "pod" (this process and the others of a multi-process job, each with its group)."""
        if self.pod is not None:
            return "pod"
        d = self.config.driver
        if d == "auto":
            # On CPU one process cannot run draft and target concurrently (XLA:CPU spreads
            # each computation over all cores), so SSD uses two pinned processes there.
            d = ("processes" if mode == "ssd" and jax.default_backend() == "cpu"
                 and None not in self.paths and self.split is None else "single")
        if d == "processes" and None in self.paths:
            raise ValueError("driver='processes' needs the target and draft given by name or "
                             "path (worker processes load them): pass strings, not models")
        return d

    def _cpu_kernel(self) -> bool:
        """Whether the models' products run on the CPU kernel (runner.py packs them for it
        where a side has one CPU device)."""
        if not self.config.cpu_kernels or jax.default_backend() != "cpu":
            return False
        if self.config.mesh is not None and max(self.config.mesh) > 1:
            return False
        from ssd_jax.kernels import cpu
        return cpu.available()

    def close(self) -> None:
        """Stop worker processes, if any were started; in a pod, the lead stops the followers."""
        if self.pool is not None:
            self.pool.close()
        if self.pod is not None and self._watchdog is not None:
            if self.pod.is_lead:
                if self._live is not None:
                    self._live.close()
                self._control.publish(dict(kind="stop"))
            self._watchdog.stop()
            self._watchdog = None

    # ---------------------------------------------------------------- pods
    def _join_pod(self) -> None:
        import atexit
        from ssd_jax.runtime.pod import Control, Watchdog, meet
        from ssd_jax.core.transport import GroupExchange
        self._control = Control(self.pod)
        self._watchdog = Watchdog(self.pod)
        self._watchdog.start()
        atexit.register(self.close)
        meet(self.pod, "engine")  # every process, before the groups' first collective
        if self.pod.role != "idle":
            self._exchange = GroupExchange(self.split.target, self.split.draft)
            try:
                self._exchange.open()
            except Exception as e:
                self._pod_failed(e)
        log.info("pod of %d processes:\n%s", self.pod.n_processes, self.pod.describe())

    def follow(self) -> None:
        """A pod process other than the lead: run this process's part of every request the
        lead publishes, until it stops (Engine.close on the lead, or its exit)."""
        from ssd_jax.runtime.pod import PodError
        if self.pod is None or self.pod.is_lead:
            raise PodError("only the non-lead processes of a pod follow")
        while True:
            msg = self._control.receive()
            if msg["kind"] == "stop":
                break
            seq = self._control.seq - 1
            if msg["kind"] == "measure":
                self._measure_in_pod(seq, msg["rows"])
                continue
            role = self.pod.role
            if role == "idle" or (role == "draft" and msg["mode"] != "ssd"):
                continue
            if msg["kind"] == "live":  # a server on the lead: mirror its live batch
                from ssd_jax.runtime.pod import Stream
                from ssd_jax.runtime.pod_live import mirror
                try:
                    live = self._pod_live(msg)
                    mirror(live, Stream(f"live/{seq}"))
                except Exception as e:
                    self._pod_failed(e)
                continue
            metrics = RunMetrics(mode=msg["mode"], batch=len(msg["ids"]),
                                 k=msg["spec"]["k"] if msg["mode"] != "ar" else 0,
                                 sync_phases=msg["sync_phases"])
            try:
                for _ in self._pod_side(msg, metrics):
                    pass
            except Exception as e:
                self._pod_failed(e)
            if role == "draft" and self.pod.process == self.pod.draft_procs[0]:
                self._control.report(seq, metrics.ssd.to_dict())
        self._watchdog.stop()
        self._watchdog = None

    def _pod_step_costs(self, rows: int) -> autotune.StepCosts:
        """The lead: each group measures its model on its own mesh at the same time (every
        process of a group runs the same forwards); the draft group's first process reports."""
        self._check_lead("measure")
        seq = self._control.publish(dict(kind="measure", rows=rows))
        try:
            target = autotune.time_scoring(self.runner, rows, autotune.TARGET_TOKENS)
        except Exception as e:
            self._pod_failed(e)
        draft = self._control.collect(seq, self.pod.draft_procs[0])
        return autotune.StepCosts(target, {int(t): s for t, s in draft.items()})

    def _measure_in_pod(self, seq: int, rows: int) -> None:
        """A follower's part of `_pod_step_costs`."""
        role = self.pod.role
        if role == "idle":
            return
        try:
            runner, tokens = ((self.runner, autotune.TARGET_TOKENS) if role == "target" else
                              (self.draft_runner, autotune.DRAFT_TOKENS))
            costs = autotune.time_scoring(runner, rows, tokens)
        except Exception as e:
            self._pod_failed(e)
        if self.pod.process == self.pod.draft_procs[0]:
            self._control.report(seq, costs)

    def _check_lead(self, what: str) -> None:
        if not self.pod.is_lead:
            from ssd_jax.runtime.pod import PodError
            raise PodError(f"{self.pod.name(self.pod.process)} follows the lead (process "
                           f"{self.pod.lead}): call Engine.follow() here, not {what}")

    def _pod_failed(self, e: Exception):
        """A step that failed in one process leaves the job's processes out of step (the
        others wait in collectives it will never join): say why in one line and end this
        process now, without JAX's exit barrier; the others see it gone (pod.Watchdog).
        A collective with a dead process fails here too (gloo: connection reset)."""
        import os
        import sys
        import traceback
        from ssd_jax.runtime.pod import EXIT_PEER_LOST
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        me = self.pod.name(self.pod.process)
        if any(w in text for w in ("Gloo", "Connection reset", "closed", "UNAVAILABLE")):
            # Another process died mid-collective. The watchdog names it once its heartbeat
            # is stale, and ends this process; wait for that rather than guess here.
            self._watchdog.join(self._watchdog.timeout + 10)
            print(f"ssd_jax: {me}: a collective with the other processes failed ({text[:160]})"
                  ": another process of the job has died; exiting", file=sys.stderr, flush=True)
            os._exit(EXIT_PEER_LOST)
        traceback.print_exc()
        print(f"ssd_jax: {me} failed ({type(e).__name__}: {text[:300]}); the job cannot go on "
              "without it: exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def _run_in_pod(self, ids, params, stops, mode, seq_len, spec: SpecConfig,
                    metrics: RunMetrics) -> Iterator[tuple[list[list[int]], RunMetrics]]:
        """The lead: publish the request, run the target group's loop here, gather the draft
        group's statistics at the end."""
        from ssd_jax.core.metrics import SSDStats
        msg = dict(kind="run", mode=mode, ids=ids, params=[asdict(p) for p in params],
                   stops=stops, spec=asdict(spec), seq_len=seq_len,
                   sync_phases=metrics.sync_phases)
        seq = self._control.publish(msg)
        chunks = self._pod_side(msg, metrics)
        try:
            for chunk in chunks:
                yield chunk, metrics
        except GeneratorExit:
            # The caller stopped reading (warmup, a closed stream); the other processes run
            # the whole request, so this one does too, or the job's collectives fall out of step.
            try:
                for _ in chunks:
                    pass
            except Exception as e:
                self._pod_failed(e)
            raise
        except Exception as e:
            self._pod_failed(e)
        if mode == "ssd" and metrics.ssd is not None:
            metrics.ssd.take_draft_side(SSDStats.from_dict(
                self._control.collect(seq, self.pod.draft_procs[0])))

    def _pod_side(self, msg: dict, metrics: RunMetrics) -> Iterator[list[list[int]]]:
        """This process's loop of a pod request (the same code in every process of a group)."""
        from ssd_jax.core.transport import DRAFT, TARGET, CollectiveLink
        params = [SamplingParams(**p) for p in msg["params"]]
        batch = make_batch(msg["ids"], params, msg["stops"], self.config.prefill_bucket)
        spec, mode = SpecConfig(**msg["spec"]), msg["mode"]
        link = None
        if mode == "ssd":
            link = CollectiveLink(self._exchange, TARGET if self.pod.role == "target" else DRAFT,
                                  batch.size, spec.k, self.model_config.vocab_size,
                                  batch.greedy_only)
        return self._decode_here(batch, mode, spec, metrics, msg["seq_len"], link=link,
                                 role=self.pod.role)

    def _live_in_pod(self, mode: str, slots: int, spec: SpecConfig):
        """The lead: open the pod's live batch (the followers build their sides of it, then
        mirror every call; runtime/pod_live.py)."""
        from ssd_jax.runtime.pod import PodError, Stream
        from ssd_jax.runtime.pod_live import LeadLive, keep_for
        self._check_lead("serve")
        if self._live is not None and not self._live.closed:
            raise PodError("this pod already has a live batch (a server): one at a time; close "
                           "it (Server.shutdown) first")
        msg = dict(kind="live", mode=mode, slots=slots, spec=asdict(spec),
                   seq_len=round_up(self.config.max_seq_len, 256))
        seq = self._control.publish(msg)
        try:
            live = self._pod_live(msg)
        except Exception as e:
            self._pod_failed(e)
        self._live = LeadLive(live, Stream(f"live/{seq}", keep_for(live.slots)),
                              self._pod_failed)
        return self._live

    def _pod_live(self, msg: dict):
        """This process's side of a pod's live batch (the same code in every process)."""
        from ssd_jax.core.live import LiveBatch
        from ssd_jax.core.transport import DRAFT, TARGET, CollectiveLink
        spec, mode, role = SpecConfig(**msg["spec"]), msg["mode"], self.pod.role
        rows = padded_shape([1] * msg["slots"], self.config.prefill_bucket)[0]
        links = {}
        if mode == "ssd":  # the batch's link and a joining row's
            links = {k: CollectiveLink(self._exchange, TARGET if role == "target" else DRAFT,
                                       b, spec.k, self.model_config.vocab_size,
                                       greedy_only=False)
                     for k, b in (("link", rows), ("join_link", 1))}
        target = self.runner if role == "target" else None  # a draft process never loads it
        draft = (self.sd_draft_runner if mode == "sd" else
                 self.draft_runner if role == "draft" else None)
        return LiveBatch(mode, target, draft, self.vocab, slots=msg["slots"],
                         seq_len=msg["seq_len"], prefill_bucket=self.config.prefill_bucket,
                         spec=spec, side=role, shardings=(self.split.target_replicated,
                                                          self.split.draft_replicated),
                         **links)

    def _workers(self):
        from ssd_jax.runtime.pool import WorkerPool
        if self.pool is None:
            self.pool = WorkerPool(self.paths[0], self.paths[1], dtype=self.dtype,
                                   devices_per_worker=self.config.worker_devices,
                                   draft_vocab=self.config.draft_vocab,
                                   cpu_kernels=self.config.cpu_kernels,
                                   draft_precision=self.config.draft_precision)
        return self.pool

    # ---------------------------------------------------------------- automatic settings
    @property
    def _pair(self) -> str:
        """The key of this pair's learnt acceptance (and Saguaro curves) in the store."""
        return autotune.pair_key(*(p or "model" for p in self.paths))

    def _cost_key(self, mode: str, rows: int, sampled: bool = False
                  ) -> tuple[str, list[str], str]:
        """(key, model names, device split) the step costs of a run are stored under.
        `sampled`: a run with sampled rows, whose learnt multiples are kept apart from greedy
        runs' (sampling over a 151k vocabulary made the Qwen pair's verification of 5 tokens
        415 ms a round at T = 0.7 against ~350 greedy, and the model, taught by both, put SD
        17% above what it ran)."""
        names = [p or f"model-{hashlib.sha1(repr(c).encode()).hexdigest()[:10]}" for p, c in
                 zip(self.paths, (self.model_config,
                                  self._draft_model and self._draft_model.config))]
        if self.config.draft_vocab is not None:  # a cut head is a cheaper draft step
            names[1] += f" (head {self.config.draft_vocab})"
        if self._cpu_kernel() and self.config.draft_precision != "fp32":  # another draft
            names[1] += f" ({self.config.draft_precision})"
        driver = self.driver(mode)
        split = driver if self.config.mesh is None else f"{driver}:{self.config.mesh}"
        if self.pod is not None:  # which processes hold the meshes matters too
            split += f":{self.pod.n_processes}x{jax.local_device_count()}"
        if self._cpu_kernel():  # the CPU kernel changes every step's cost
            split += ", cpu kernel"
        if sampled:
            split += ", sampled"
        return autotune.cache_key(*names, rows, self.dtype, split), names, split

    def _step_costs(self, mode: str, rows: int, sampled: bool = False) -> autotune.StepCosts:
        """Measured once per machine, pair, batch bucket and device split; then read back.
        `sampled`: the entry of sampled runs, which starts as a copy of the greedy one (the
        same forward passes, and what greedy runs taught as a first guess) and then learns
        from sampled runs alone."""
        driver = self.driver(mode)
        key, names, split = self._cost_key(mode, rows, sampled)
        store = autotune.TuneStore(autotune.store_path(self.cache_dir))
        costs = store.costs(key)
        if costs is None and sampled:
            costs = self._step_costs(mode, rows)
            # Saved without the rounds they were learnt over: a sampled run's first lesson
            # replaces the greedy figure rather than blending with it.
            store.save_costs(key, costs, note=f"{names[0]} + {names[1]}, batch {rows}, {split}"
                             " (from the greedy entry)")
        if costs is None:
            log.info("measuring the target's scoring cost%s (batch %d, once per machine and "
                     "pair) ...", " and the draft's step cost" if self.has_draft else "", rows)
            if not self.has_draft:  # AR alone (`ssd-bench --mode ar`): its step is all it reads
                costs = autotune.StepCosts(autotune.time_scoring(self.runner, rows, (1,)), {})
            elif driver == "processes":
                costs = self._workers().step_costs(rows)
            elif driver == "pod":
                costs = self._pod_step_costs(rows)
            else:
                costs = autotune.StepCosts(
                    autotune.time_scoring(self.runner, rows, autotune.TARGET_TOKENS),
                    autotune.time_scoring(self.draft_runner, rows, autotune.DRAFT_TOKENS))
            store.save_costs(key, costs, note=f"{names[0]} + {names[1]}, batch {rows}, {split}")
        return costs

    def _spec_for(self, spec: SpecConfig, mode: str, rows: int,
                  sampling: SamplingParams | None = None, answer_tokens: int | None = None
                  ) -> tuple[SpecConfig, autotune.Choice | None]:
        """The settings of this run: the caller's, or chosen through the speed model.
        `sampling`: the run's (first sampled row's) settings, for Saguaro's C.
        `answer_tokens`: the tokens its longest answer decodes after the prefill's (the model
        then counts the rounds such an answer takes: autotune.rounds_per_answer)."""
        if mode == "ar" or not spec.auto:
            self._saguaro(mode, sampling, measure=False)  # for learn(), if one is stored
            return replace(spec, backup=spec.backup_or_default, c=spec.c or 1.0), None
        a, r = autotune.TuneStore(autotune.store_path(self.cache_dir)).acceptance(self._pair)
        curve = self._saguaro(mode, sampling)  # a sampled run's hit model, given C or not
        sampled = sampling is not None and sampling.temperature > 0
        choice = autotune.choose(self._step_costs(mode, rows, sampled), a=a, r=r, batch=rows,
                                 mode=mode, saguaro=curve, c=spec.c,
                                 answer=self._answer(answer_tokens))
        if choice != self._logged_choice:  # warmup and the run choose alike: say it once
            log.info("automatic settings (%s): %s", mode.upper(), choice.describe())
            if not choice.ar_is_faster(mode):
                self._warned_slow.discard(mode)  # a later verdict against it is news again
            else:
                # Acted on only with ar_fallback (run): otherwise the run is the mode asked
                # for (a bench cell, a user comparing modes).
                what = ("runs decode with AR steps instead (ar_fallback), speculating now and "
                        "then to keep learning acceptance" if spec.ar_fallback else
                        "mode='ar' (--mode ar) would be faster for this workload, or "
                        "SpecConfig(ar_fallback=True) (--ar-fallback) to switch on its own")
                ours, ar = choice.tok_s[mode], choice.tok_s["ar"]
                digits = next((d for d in (1, 2, 3) if f"{ours:.{d}f}" != f"{ar:.{d}f}"), 4)
                level = logging.INFO if mode in self._warned_slow else logging.WARNING
                self._warned_slow.add(mode)
                log.log(level, "the speed model predicts %s at %.*f tok/s, below AR's %.*f, "
                        "with this pair's recent acceptance (a=%.2f): %s", mode.upper(),
                        digits, ours, digits, ar, choice.a, what)
            self._logged_choice = choice
        return replace(spec, k=choice.k, budget=choice.budget,
                       backup=spec.backup or choice.backup,
                       c=spec.c or choice.c or 1.0), choice

    def _answer(self, tokens: int | None) -> tuple[int, int] | None:
        """autotune.predict's `answer` for answers of `tokens` tokens after the prefill's."""
        return None if tokens is None or tokens < 1 else (tokens, self.config.sync_every)

    def _saguaro(self, mode: str, sampling: SamplingParams | None, measure: bool = True):
        """How C moves acceptance and hit rate for this pair at these sampling settings
        (saguaro_curve.py), measured once and cached; None for greedy runs, for pairs without a
        tokenizer (no calibration text) and on a pod (not measured across processes: C = 1).
        Not `measure`: the stored curve or None (a run with given settings)."""
        from ssd_jax.saguaro_curve import CALIBRATION_PROMPT, POSITIONS, SaguaroCurve
        from ssd_jax.saguaro_curve import target_calibration, teacher_forced_probs
        if (mode != "ssd" or sampling is None or sampling.temperature == 0
                or self.tokenizer is None or self.pod is not None):
            return None
        t, top_k, top_p = float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)
        min_p = float(sampling.min_p)
        key = f"{self._pair}|head {self.config.draft_vocab}|T={t:g}|top_k={top_k}|top_p={top_p:g}"
        if min_p:
            key += f"|min_p={min_p:g}"
        store = autotune.TuneStore(autotune.store_path(self.cache_dir))
        curve = store.saguaro(key)
        if curve is None and not measure:
            self._curve = self._curve_key = None
            return None
        if curve is None:
            log.info("measuring how Saguaro's C moves acceptance and hit rate (T=%g; once per "
                     "pair and sampling settings) ...", t)
            tok = self.tokenizer
            text = (tok.apply_chat_template([{"role": "user", "content": CALIBRATION_PROMPT}])
                    if tok.chat_template else CALIBRATION_PROMPT)
            ids = tok.encode(text, add_special_tokens=not tok.chat_template)
            if self.driver(mode) == "processes":
                p, q = self._workers().calibration_probs(ids, POSITIONS, t, top_k, top_p,
                                                         min_p)
            else:
                more, p = target_calibration(self.runner, ids, t, top_k, top_p, POSITIONS,
                                             self.split and self.split.target_replicated,
                                             min_p)
                q = teacher_forced_probs(self.draft_runner, ids + more, t, top_k, top_p,
                                         self.vocab, last=len(more), min_p=min_p)
            curve = SaguaroCurve.fit(p, q)
            store.save_saguaro(key, curve)
        self._curve, self._curve_key = curve, key
        return curve

    def learn(self, mode: str, metrics: RunMetrics, greedy: bool = False) -> None:
        """Keep this pair's measured acceptance for the next automatic choice, weighted by
        the evidence: a running mean over the last ~ACCEPT_WINDOW rounds (TuneStore.observe;
        acceptance moves with the kind of prompt: code 0.88, chat 0.65 on the Qwen pair, and
        from prompt to prompt). An SSD run also teaches the hit model's r (from a
        greedy run's hit rate: the model with the prior r said 0.88 where code hit 0.77) and
        how much slower its two sides ran side by side than alone, an SD run its drafting,
        AR and SD runs their target steps (_learn_scales).
        `mode`: the mode the run was asked for (its device split); an ar_fallback run
        (metrics.mode "ar") teaches the AR steps of that split.
        `greedy`: every row of the run was greedy."""
        if metrics.mode == "ar":
            self._learn_ar_scale(metrics, mode, sampled=not greedy)
            return
        rounds = sum(metrics.accept_hist)
        if rounds < 8:
            return
        a = autotune.acceptance_from_rounds(metrics.accept_hist)
        s = metrics.settings or {}
        hit = fan = None
        if mode == "sd" or metrics.ssd is not None:
            self._learn_scales(mode, metrics, sampled=not greedy)
        if mode == "ssd" and metrics.ssd is not None:
            fan = metrics.ssd.fanout or s.get("fanout_lists")
            # Each row's first round misses by construction (no cache yet: draft.empty_cache),
            # which the hit model does not count; in a short run it is a tenth of the rounds.
            # Only whole answers teach r: the start of an answer hits more often than the rest
            # (32-token probes of code taught r = 1.66, promising 0.87; whole answers hit 0.70).
            st = metrics.ssd
            if (fan is not None and len(fan) == len(metrics.accept_hist)
                    and st.rounds >= STEADY_ROUNDS * metrics.batch):
                steady = min(st.hits / max(st.rounds - metrics.batch, 1), 1.0)
                if greedy:
                    hit = steady
                elif self._curve is not None:
                    self._learn_sampled_hits(steady, fan, a, s.get("c") or 1.0, rounds)
            if hit is None:
                fan = None
        if (s.get("c") or 1.0) != 1.0 and self._curve is not None:
            # A run at Saguaro's C < 1 accepts less by design: keep what C = 1 would accept
            # (the latest curve's ratio, over an even split of the run's branches).
            even = [max(1, s["budget"] // (s["k"] + 1))] * (s["k"] + 1)
            a = min(0.98, a / max(self._curve.acceptance(1.0, s["c"], even), 1e-3))
        autotune.TuneStore(autotune.store_path(self.cache_dir)).observe(
            self._pair, a, hit, fan, rounds=rounds)

    def _learn_sampled_hits(self, hit: float, fan, a: float, c: float, rounds: int) -> None:
        """A sampled run's steady hit rate over what the calibration curve promised at the
        run's C, fan-out and acceptance: the curve's hit_scale (its greedy counterpart is r)."""
        promised = self._curve.hit_rate(c, fan, a, learnt=False)
        if promised > 0:
            store = autotune.TuneStore(autotune.store_path(self.cache_dir))
            store.observe_saguaro_hits(self._curve_key, hit / promised, rounds=rounds)

    def forget_acceptance(self) -> None:
        """Start this pair's acceptance and hit model afresh: the runs that follow teach them
        alone (a bench probing a new workload; a server whose traffic changed kind)."""
        autotune.TuneStore(autotune.store_path(self.cache_dir)).forget(self._pair)
        self._warned_slow.clear()  # a new workload: its verdict is news

    def forget_timings(self, mode: str, rows: int, sampled: bool = False) -> None:
        """Let the next runs of `mode` at `rows` (padded) rows teach the step costs' multiples
        afresh (TuneStore.restart_multiples): what a decode's steps cost against the start-up
        timings. Pooled over ACCEPT_WINDOW rounds, an earlier hour's figures kept about half
        their weight after a whole suite of new answers, and these VMs' speed drifts 10-25%
        within an hour: session 45's T = 0.7 SD cell, chosen after such a probe, was
        predicted a 1,039 ms round where it ran 1,189 (+20% tok/s); the store held 1,152
        after the run. `sampled`: the entry of sampled runs."""
        store = autotune.TuneStore(autotune.store_path(self.cache_dir))
        store.restart_multiples(self._cost_key(mode, rows, sampled)[0])

    def _learn_ar_scale(self, metrics: RunMetrics, asked: str = "ar", sampled: bool = False
                        ) -> None:
        """An AR run's steps against target(1) (autotune.target_scale_of_run), where step
        costs are stored for its batch and split. Timed a chunk at a time (the host reads
        sync_every steps at once), without the first: a new program compiles inside it (a
        bench's warm-up answer taught 1.3x where its steps ran 1.0x), too little spread over
        its steps for per_round's outlier cut to catch."""
        chunks = metrics.step_chunks[1:]
        if len(chunks) < 8:
            return
        key = self._cost_key(asked, 1 << (metrics.batch - 1).bit_length(), sampled)[0]
        store = autotune.TuneStore(autotune.store_path(self.cache_dir))
        costs = store.costs(key)
        got = None if costs is None else autotune.target_scale_of_run(costs, 1, chunks)
        if got is not None:
            steps = metrics.decode_steps * len(chunks) // len(metrics.step_chunks)
            store.observe_target_scale(key, 1, got, rounds=steps)

    def ar_prediction(self, rows: int, measure: bool = False, sampled: bool = False
                      ) -> float | None:
        """The speed model's AR tok/s for a run of `rows` (padded) rows: None where no step
        costs are stored for it (automatic settings measure them; AR does not), unless
        `measure` (then measured and stored as automatic settings would). `sampled`: for a
        run with sampled rows."""
        costs = (self._step_costs("ar", rows, sampled) if measure else
                 autotune.TuneStore(autotune.store_path(self.cache_dir)).costs(
                     self._cost_key("ar", rows, sampled)[0]))
        return None if costs is None else rows / costs.target_run(1)

    def _learn_scales(self, mode: str, metrics: RunMetrics, sampled: bool = False) -> None:
        """A run whose phases were timed per round (worker processes always are) against the
        stored step costs of its batch and split: SSD's verification and build side by side
        (autotune.overlap_of_run), SD's drafting (autotune.sd_draft_scale_of_run) and
        verification (autotune.target_scale_of_run)."""
        s = metrics.settings or {}
        if not metrics.verify_rounds or "rows" not in s:
            return
        key = self._cost_key(mode, s["rows"], sampled)[0]
        store = autotune.TuneStore(autotune.store_path(self.cache_dir))
        costs = store.costs(key)
        if costs is None or s["k"] + 1 not in costs.target:
            return  # settings given by the caller: nothing measured (at this K) to compare with
        weight = dict(rounds=len(metrics.verify_rounds))
        if mode == "ssd":
            got = autotune.overlap_of_run(costs, s["k"], s["budget"], s["backup"],
                                          metrics.ssd.all_hit_rate, metrics.verify_rounds,
                                          metrics.ssd.build_rounds)
            if got is not None:
                store.observe_scales(key, **weight, verify_overlap=got[0], build_overlap=got[1])
            # The wait after verification is the overlap's remainder only where the two sides
            # run apart (worker processes, a pod); in one process it holds the whole build.
            spread = (autotune.spread_of_run(
                costs, s["k"], s["backup"], metrics.ssd.all_hit_rate, metrics.verify_rounds,
                metrics.ssd.build_rounds, metrics.ssd.exposed_s / max(metrics.decode_steps, 1))
                if self.driver(mode) != "single" else None)
            if spread is not None:
                store.observe_scales(key, **weight, round_spread=spread)
        else:
            got = autotune.sd_draft_scale_of_run(costs, s["k"], metrics.draft_rounds)
            if got is not None:
                store.observe_scales(key, **weight, sd_draft_scale=got)
            got = autotune.target_scale_of_run(costs, s["k"] + 1, metrics.verify_rounds)
            if got is not None:
                store.observe_target_scale(key, s["k"] + 1, got, **weight)

    def settings(self, mode: str, rows: int, spec: SpecConfig,
                 sampling: SamplingParams | None = None) -> tuple[SpecConfig, dict | None]:
        """The settings a run of `rows` (padded) rows would use now, resolved (automatic ones
        chosen, measuring step costs once), and their description as metrics.settings has it.
        `sampling`: the run's settings (Saguaro's C is chosen for sampled ones; its
        max_new_tokens sets the answer length the prediction counts rounds for)."""
        answer = None if sampling is None else sampling.max_new_tokens - 1
        resolved, choice = self._spec_for(spec, mode, rows, sampling, answer)
        greedy = sampling is None or sampling.temperature == 0
        return resolved, self._settings(resolved, mode, choice, rows, greedy, answer)

    def _settings(self, spec: SpecConfig, mode: str, choice: autotune.Choice | None,
                  rows: int, greedy: bool = False, answer_tokens: int | None = None
                  ) -> dict | None:
        """What ran, for metrics and bench results: settings and, when chosen, the prediction.
        `rows`: the padded batch (the key of its step costs). Settings given by the caller get
        the same model's prediction for them when the run is greedy (`greedy`) and step costs
        are stored (never measured for it), so a sweep's every cell can be held to the model."""
        if mode == "ar":
            return None
        out = dict(k=spec.k, budget=spec.branches, fanout=spec.fanout, backup=spec.backup,
                   c=spec.c, automatic=choice is not None, rows=rows)
        if choice is not None:
            out.update(predicted_tok_s=choice.tok_s[mode], predicted=choice.tok_s,
                       a_prior=choice.a, fanout_lists=choice.fanout,
                       predicted_hit_rate=choice.hit_rate, r_prior=choice.r,
                       overlap=list(choice.overlap))
        elif (greedy and spec.fanout == "geometric" and (spec.c or 1.0) == 1.0
              and spec.backup in ("neural", "fast")):
            store = autotune.TuneStore(autotune.store_path(self.cache_dir))
            costs = store.costs(self._cost_key(mode, rows)[0])
            if costs is not None and spec.k + 1 in costs.target:
                a, r = store.acceptance(self._pair)
                pred = autotune.predict(costs, spec.k, spec.branches, a=a, r=r, batch=rows,
                                        backup=spec.backup, answer=self._answer(answer_tokens))
                out.update(predicted_tok_s=pred[mode], predicted_hit_rate=pred["hit_rate"],
                           a_prior=a, r_prior=r, fanout_lists=pred["fanout"],
                           overlap=[costs.verify_overlap, costs.build_overlap,
                                    costs.round_spread])
        return out

    # ---------------------------------------------------------------- runs
    def _plan(self, ids: list[list[int]], params: list[SamplingParams], mode: str,
              spec: SpecConfig) -> tuple[SpecConfig, autotune.Choice | None, Shapes]:
        """The run's settings and the shapes it compiles for; raises when it does not fit."""
        fits = (self.config, self.model_config.max_position_embeddings)
        check_fits(ids, params, mode, *fits)  # batch size and context, before any measuring
        rows, prompt = padded_shape([len(t) for t in ids], self.config.prefill_bucket)
        sampled = next((p for p in params if p.temperature > 0), None)
        spec, choice = self._spec_for(spec, mode, rows, sampled, _answer_tokens(params))
        need = check_fits(ids, params, mode, *fits, k=spec.k or 0)
        return spec, choice, (rows, prompt, _cache_len(need, prompt, mode, spec.k))

    def shapes(self, ids: list[list[int]], params: list[SamplingParams], mode: str,
               spec: SpecConfig) -> Shapes:
        """(padded batch, prompt bucket, cache length) that `run` compiles for. With automatic
        settings (spec.k None) this chooses K as the run would, measuring step costs once."""
        return self._plan(ids, params, mode, spec)[2]

    def run(self, ids: list[list[int]], params: list[SamplingParams], stops: list[list[int]],
            mode: str, spec: SpecConfig, sync_phases: bool = False
            ) -> Iterator[tuple[list[list[int]], RunMetrics]]:
        """Yields (new tokens per real row, metrics) chunk by chunk. `stops`: each row's stop
        ids; `sync_phases`: block between draft and verify to time each phase (this process)."""
        self.last_choice = None
        spec, choice, (rows, prompt, seq_len) = self._plan(ids, params, mode, spec)
        self.last_choice = choice
        ran, settings, predicted = self._decide(mode, spec, choice, rows, params)
        chunks = self._run_mode(ids, params, stops, ran, mode, seq_len, spec, settings,
                                sync_phases)
        try:
            for chunk, metrics in chunks:
                self._count(mode, ran, predicted, chunk)
                yield chunk, metrics
        finally:
            chunks.close()  # a caller that stops reading stops the run (a pod finishes it)

    def _decide(self, mode: str, spec: SpecConfig, choice: autotune.Choice | None, rows: int,
                params: list[SamplingParams]) -> tuple[str, dict | None, dict | None]:
        """The mode a run decodes with (AR in place of `mode` where SpecConfig.ar_fallback
        says so), its metrics.settings, and the speed model's prediction it decided on (None:
        nothing to decide)."""
        settings = self._settings(spec, mode, choice, rows,
                                  all(p.temperature == 0 for p in params), _answer_tokens(params))
        predicted = self._fallback_prediction(mode, spec, choice, rows, params)
        if predicted is not None:  # what this call decided on, whichever way it went
            settings.update(predicted=predicted)
        count = self._fallback.setdefault(mode, [0, 0])
        if self._falls_back(mode, predicted, count):
            # AR where the asked mode's target runs (its driver, devices and cost entry);
            # the settings say what was chosen and why it did not run.
            settings.update(ar_fallback=True)
            return "ar", settings, predicted
        if predicted is not None:  # a speculative run: the fallback's count starts again
            count[:] = [0, 0]
        return mode, settings, predicted

    def _count(self, mode: str, ran: str, predicted: dict | None, chunk) -> None:
        """A run's tokens, for ar_fallback's probes: decoded with AR in place of `mode`, or
        speculated."""
        if predicted is not None:
            self._fallback[mode][0 if ran != mode else 1] += tokens_in(chunk)

    def _fallback_prediction(self, mode: str, spec: SpecConfig,
                             choice: autotune.Choice | None, rows: int,
                             params: list[SamplingParams]) -> dict | None:
        """The speed model's tok/s per mode ("ar", "sd", "ssd") that an ar_fallback run
        decides on: the automatic choice's, or the model's at the settings given (step costs
        measured once if none are stored); None where there is nothing to decide (no
        ar_fallback, mode AR, settings the model does not cover)."""
        if mode == "ar" or not spec.ar_fallback:
            return None
        if choice is not None:
            return dict(choice.tok_s)
        if spec.fanout != "geometric" or spec.backup not in ("neural", "fast"):
            return None
        sampling = next((p for p in params if p.temperature > 0), None)
        costs = self._step_costs(mode, rows, sampled=sampling is not None)
        if spec.k + 1 not in costs.target:
            return None
        a, r = autotune.TuneStore(autotune.store_path(self.cache_dir)).acceptance(self._pair)
        pred = autotune.predict(costs, spec.k, spec.branches, a=a, r=r, batch=rows,
                                backup=spec.backup, c=spec.c or 1.0,
                                saguaro=self._saguaro(mode, sampling),
                                answer=self._answer(_answer_tokens(params)))
        return {x: pred[x] for x in ("ar", "sd", "ssd")}

    def _falls_back(self, mode: str, predicted: dict | None, count: list[int]) -> bool:
        """Whether this run decodes with AR in place of `mode` (SpecConfig.ar_fallback):
        `predicted` puts AR faster, and the AR tokens since `mode` last speculated (`count`)
        are not yet due a probe."""
        if predicted is None or predicted[mode] >= predicted["ar"]:
            return False
        if count[0] >= max(PROBE_TOKENS, PROBE_RATIO * count[1]):
            log.info("ar_fallback: %d tokens decoded with AR; this run speculates (%s) to "
                     "refresh the pair's acceptance", count[0], mode.upper())
            return False
        return True

    def _run_mode(self, ids, params, stops, mode: str, asked: str, seq_len: int,
                  spec: SpecConfig, settings: dict | None, sync_phases: bool
                  ) -> Iterator[tuple[list[list[int]], RunMetrics]]:
        """A run of `mode` with the driver of `asked` (the mode the caller asked for)."""
        if self.driver(asked) == "processes":
            metrics = RunMetrics(mode=mode, batch=len(ids), settings=settings)
            yield from self._run_in_workers(ids, params, stops, mode, seq_len, spec, metrics)
            return
        metrics = RunMetrics(mode=mode, batch=len(ids), sync_phases=sync_phases,
                             k=spec.k if mode != "ar" else 0, settings=settings)
        if self.pod is not None:
            self._check_lead("run")
            if self._live is not None and not self._live.closed:
                from ssd_jax.runtime.pod import PodError
                raise PodError("this pod's processes are serving a live batch (a server): "
                               "offline runs wait until it is closed (Server.shutdown)")
            yield from self._run_in_pod(ids, params, stops, mode, seq_len, spec, metrics)
            return
        batch = make_batch(ids, params, stops, self.config.prefill_bucket)
        for chunk in self._decode_here(batch, mode, spec, metrics, seq_len):
            yield chunk, metrics

    def _run_in_workers(self, ids, params, stops, mode, seq_len, spec: SpecConfig,
                        metrics: RunMetrics) -> Iterator[tuple[list[list[int]], RunMetrics]]:
        request = dict(mode=mode, ids=ids, params=[asdict(p) for p in params],
                       stops=stops,
                       prefill_bucket=self.config.prefill_bucket, spec=asdict(spec),
                       seq_len=seq_len, sync_every=self.config.sync_every,
                       backup=spec.backup)
        run = self._workers().run(request)
        while True:
            try:
                chunk = next(run)
            except StopIteration as stop:
                # new_tokens is counted here, on the host that cuts rows at their stop.
                metrics.__dict__.update({k: v for k, v in stop.value.__dict__.items()
                                         if k not in ("new_tokens", "settings")})
                return
            yield chunk, metrics

    def live(self, mode: str, slots: int, spec: SpecConfig, *, seq_len: int | None = None,
             greedy_only: bool = False, penalties: bool = True, driver: str | None = None):
        """A `core.live.LiveBatch` of `slots` rows decoding `mode` (a server's continuous
        batch), with the settings it resolved (automatic ones chosen for `slots`): in this
        process, in the worker processes (runtime/pool_live.py) or across a pod, by `driver`
        (None: `mode`'s). `seq_len`: its cache (None: the context, max_seq_len);
        `greedy_only` / `penalties`: its programs' flags (the defaults serve any request; a
        pod's batch keeps the defaults and the context, as its followers build it)."""
        from ssd_jax.core.live import LiveBatch
        spec, _ = self._spec_for(spec, mode, slots)
        if self.pod is not None:
            return self._live_in_pod(mode, slots, spec), spec
        if (driver or self.driver(mode)) == "processes":
            return self._workers().live(
                mode, slots, spec, seq_len=round_up(seq_len or self.config.max_seq_len, 256),
                prefill_bucket=self.config.prefill_bucket, greedy_only=greedy_only,
                penalties=penalties), spec
        link = LocalLink() if self.split is None else LocalLink(
            self.split.target_replicated, self.split.draft_replicated)
        draft = (None if mode == "ar" else
                 self.sd_draft_runner if mode == "sd" else self.draft_runner)
        return LiveBatch(mode, self.runner, draft, self.vocab, slots=slots,
                         seq_len=round_up(seq_len or self.config.max_seq_len, 256),
                         prefill_bucket=self.config.prefill_bucket, spec=spec, link=link,
                         greedy_only=greedy_only, penalties=penalties), spec

    def continuous(self, params: list[SamplingParams], stops: list[list[int]]) -> bool:
        """Whether a call of these rows decodes as one continuous batch (continuous.py):
        more rows than max_batch, EngineConfig.continuous, and rows a live batch holds (its
        fixed widths of stop ids and logit biases; the consecutive batches hold any). Every
        driver has live batches: this process, the worker processes, a pod."""
        from ssd_jax.core.live import BIAS_WIDTH, STOP_WIDTH
        return (len(params) > self.config.max_batch and self.config.continuous
                and all(len(s) <= STOP_WIDTH for s in stops)
                and all(len(p.logit_bias) <= BIAS_WIDTH for p in params))

    def live_shapes(self, ids: list[list[int]], params: list[SamplingParams], mode: str,
                    spec: SpecConfig) -> Shapes:
        """`shapes` of a continuous run (max_batch slots, the longest prompt's bucket, the
        cache of the longest row)."""
        return self._live_plan(ids, params, mode, spec)[2]

    def _live_plan(self, ids: list[list[int]], params: list[SamplingParams], mode: str,
                   spec: SpecConfig) -> tuple[SpecConfig, autotune.Choice | None, Shapes]:
        """_plan for a continuous run: max_batch slots, each prompt's own bucket (a row joins
        alone), the cache sized for the call's longest row."""
        fits = (self.config, self.model_config.max_position_embeddings)
        for t, p in zip(ids, params):
            check_fits([t], [p], mode, *fits)
        rows = 1 << (self.config.max_batch - 1).bit_length()
        sampled = next((p for p in params if p.temperature > 0), None)
        spec, choice = self._spec_for(spec, mode, rows, sampled)
        need = max(check_fits([t], [p], mode, *fits, k=spec.k or 0)
                   for t, p in zip(ids, params))
        prompt = round_up(max(len(t) for t in ids), self.config.prefill_bucket)
        return spec, choice, (rows, prompt, _cache_len(need, prompt, mode, spec.k))

    def run_continuous(self, ids: list[list[int]], params: list[SamplingParams],
                       stops: list[list[int]], mode: str, spec: SpecConfig,
                       ended) -> Iterator[tuple[list[list[int]], RunMetrics]]:
        """`run` for more rows than max_batch, as one continuous batch of max_batch slots
        (continuous.py); `ended(i)`: the caller has ended row i (its slot frees)."""
        from ssd_jax import continuous
        self.last_choice = None
        spec, choice, (rows, _, seq_len) = self._live_plan(ids, params, mode, spec)
        self.last_choice = choice
        ran, settings, predicted = self._decide(mode, spec, choice, rows, params)
        # `ran` runs where the asked mode's target runs (its driver), as in `run`. On a pod the
        # batch is the server's (its programs serve any row; the followers mirror it).
        live, _ = self.live(ran, rows, spec, seq_len=seq_len,
                            greedy_only=all(p.temperature == 0 for p in params),
                            penalties=any(p.penalized for p in params), driver=self.driver(mode))
        metrics = RunMetrics(mode=ran, batch=len(ids), k=spec.k if ran != "ar" else 0,
                             settings=settings)
        try:
            for chunk in continuous.decode(live, ids, params, stops, ended, metrics):
                self._count(mode, ran, predicted, chunk)
                yield chunk, metrics
        finally:
            live.close()  # worker processes drop their sides (a caller may stop reading early)

    def _decode_here(self, batch: Batch, mode: str, spec: SpecConfig, metrics: RunMetrics,
                     seq_len: int, link=None, role: str | None = None
                     ) -> Iterator[list[list[int]]]:
        """The decode loop of `mode` in this process, on the device split if there is one.
        In a pod, `link` is the groups' CollectiveLink and `role` this process's group: the
        loop runs that side only."""
        if link is None:
            link = LocalLink() if self.split is None else LocalLink(
                self.split.target_replicated, self.split.draft_replicated)
        if role == "draft":
            draft = DraftSide.create(self.draft_runner, self.vocab,
                                     batch.place(self.split.draft_replicated), spec, seq_len,
                                     link.to_draft)
            return ssd_loop(None, draft, link, metrics, self.config.sync_every,
                            timed=metrics.sync_phases)
        placed = self.split and self.split.target_replicated
        target = TargetSide(self.runner, batch.place(placed),
                            self.runner.new_cache(batch.size, seq_len))
        if mode == "ar":
            return ar_loop(target, metrics, self.config.sync_every)
        if mode == "sd":
            draft = self.sd_draft_runner
            return sd_loop(target, draft, self.vocab, draft.new_cache(batch.size, seq_len),
                           metrics, self.config.sync_every)
        if role == "target":
            return ssd_loop(target, None, link, metrics, self.config.sync_every,
                            timed=metrics.sync_phases)
        draft = DraftSide.create(self.draft_runner, self.vocab,
                                 batch.place(self.split and self.split.draft_replicated), spec,
                                 seq_len, link.to_draft)
        return ssd_loop(target, draft, link, metrics, self.config.sync_every,
                        timed=metrics.sync_phases)


def _answer_tokens(params: list[SamplingParams]) -> int:
    """The tokens a call's longest answer decodes after the prefill's first one: what the
    speed model counts rounds for (autotune.rounds_per_answer)."""
    return max(p.max_new_tokens for p in params) - 1


def _cache_len(need: int, prompt: int, mode: str, k: int | None) -> int:
    """A run's cache: the positions it needs, and the slack a speculative round writes past
    the committed length (K+1 slots), in multiples of 256."""
    return round_up(max(need, prompt) + (k + 2 if mode != "ar" else 1), 256)
