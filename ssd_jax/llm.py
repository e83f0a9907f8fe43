"""The user-facing API: `LLM(model).generate(prompts, SamplingParams(...))` and `stream(...)`.

Load once, generate many times. Prompts in a batch may differ in length (right-padded to a
bucket); shapes are bucketed so repeated calls reuse compiled programs. `LLM` is a thin facade:
prompts are `ssd_jax.prompts`' job, models and decoding `ssd_jax.engine.Engine`'s.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence, no_type_check

from ssd_jax import autotune, stop_strings
from ssd_jax.config import EngineConfig, SamplingParams, SpecConfig
from ssd_jax.engine import Engine, Shapes
from ssd_jax.loading.tokenizer import Tokenizer
from ssd_jax.core.metrics import RunMetrics
from ssd_jax.core.rounds import PromptLogprobs
from ssd_jax.models.transformer import Transformer
from ssd_jax.prompts import Prompt, Prompts, check_fits, prompt_kind, short


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (stop/EOS token) or "length" (max_new_tokens)
    metrics: RunMetrics | None = field(default=None, repr=False)
    # SamplingParams.logprobs given: per generated token, {token id: log-probability} for the
    # token and the top alternatives (the target's raw distribution, core/logprobs.py).
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    # SamplingParams.prompt_logprobs given: the same per prompt token, None for the first
    # (nothing predicts it), as vLLM's.
    prompt_logprobs: list[dict[int, float] | None] | None = field(default=None, repr=False)


@dataclass
class _Progress:
    """A generate call's rows so far (one list entry per row): tokens, finish reason (None
    while running), token and prompt log-probabilities, and the text of a row that ended on
    a stop string (None otherwise: its text is its tokens' text)."""
    out: list[list[int]]
    reason: list[str | None]
    lps: list[list | None]
    prompt_lps: list[list | None]
    text: list[str | None]

    def final_text(self, i: int, decode) -> str:
        return self.text[i] if self.text[i] is not None else decode(self.out[i])


def _entry(token: int, chosen: float, top: dict, n: int) -> dict[int, float]:
    """A token's log-probability entry: the n most likely of `top` and the token itself."""
    return {**dict(list(top.items())[:n]), int(token): chosen}


def _check_config(name: str, value, cls) -> None:
    if not isinstance(value, cls):
        raise ValueError(f"{name}={short(value)} is invalid: pass {name}={cls.__name__}(...)")


class LLM:
    """A target model (and later a draft) loaded once, with its tokenizer and jitted programs.

    `model` is a name ("smollm2"), a .gguf file, an HF directory or an ssd_jax orbax directory;
    or an already built `Transformer` (then pass `tokenizer`, or give token-id prompts).
    `spec` is the default of every call; `generate`/`stream`/`warmup` take `spec=` (and
    `sync_phases=`) to override it for one call.
    """

    # The public methods check their own arguments, with errors that name the fix; the test
    # run's type-check hook (tests/conftest.py) is kept off them, or it would pre-empt those.
    @no_type_check
    def __init__(self, model: str | Path | Transformer = "smollm2", *,
                 draft: str | Path | Transformer | None = None,
                 tokenizer: Tokenizer | None = None, dtype: str = "float32",
                 spec: SpecConfig = SpecConfig(), engine: EngineConfig = EngineConfig(),
                 cache_dir: Path | None = None, progress: bool = True):
        _check_config("spec", spec, SpecConfig)
        _check_config("engine", engine, EngineConfig)
        self.core = Engine(model, draft, tokenizer=tokenizer, dtype=dtype, config=engine,
                           cache_dir=cache_dir, progress=progress)
        self.prompts = Prompts(self.core.tokenizer, self.core.model_config, engine.seed)
        self._spec = spec
        self.last_metrics: RunMetrics | None = None  # of the latest generate/stream call
        self.last_token_ids: list[int] | None = None  # of the latest stream, to compare runs

    # ---------------------------------------------------------------- what was built
    @property
    def spec(self) -> SpecConfig:
        """The default speculation settings (a call's `spec=` overrides them)."""
        return self._spec

    @property
    def engine(self) -> EngineConfig:
        return self.core.config

    @property
    def config(self):
        """The target's ModelConfig."""
        return self.core.model_config

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.core.tokenizer

    @property
    def paths(self) -> tuple[str | None, str | None]:
        """(target, draft) names or paths; None for a model passed as a `Transformer`."""
        return self.core.paths

    @paths.setter
    def paths(self, value: tuple[str | None, str | None]) -> None:
        # Points worker processes started later elsewhere (a test makes them fail this way).
        self.core.paths = value

    @property
    def vocab(self):
        """The draft->target vocabulary map (None: the draft speaks the target's ids)."""
        return self.core.vocab

    @property
    def has_draft(self) -> bool:
        return self.core.has_draft

    @property
    def pool(self):
        """The worker processes of the "processes" driver (None until first used)."""
        return self.core.pool

    @property
    def model(self) -> Transformer:
        return self.core.model

    @property
    def runner(self):
        return self.core.runner

    @property
    def draft_runner(self):
        return self.core.draft_runner

    @property
    def last_choice(self) -> autotune.Choice | None:
        """The automatic settings of the latest run (None when the settings were given)."""
        return self.core.last_choice

    def driver(self, mode: str) -> str:
        """Where a run of `mode` executes: "single" (this process) or "processes"."""
        return self.core.driver(mode)

    def close(self) -> None:
        """Stop worker processes, if any were started (in a pod, the lead stops the others)."""
        self.core.close()

    # ---------------------------------------------------------------- pods (runtime/pod.py)
    @property
    def is_lead(self) -> bool:
        """False on the processes of a multi-process job that follow its lead (the target
        group's first process, which owns requests and results); True everywhere else."""
        return self.core.pod is None or self.core.pod.is_lead

    def follow(self) -> None:
        """On a pod's non-lead processes: run this process's part (target shards, the draft
        side, or nothing) of every request the lead makes, until the lead closes. Every host
        runs the same script:

            llm = LLM(target, draft=draft, engine=EngineConfig(mesh=(16, 8)))
            if not llm.is_lead:
                llm.follow()
                sys.exit(0)
            print(llm.generate(prompts))
        """
        self.core.follow()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- runs
    # The checks below take `object`: they exist to refuse wrong types with a message.
    def _call(self, mode: str | None, spec: object, sync_phases: object
              ) -> tuple[str, SpecConfig, bool]:
        """A call's mode and per-call overrides, checked before any prompt is touched."""
        return self.core.resolve_mode(mode), self._call_spec(spec), self._sync(sync_phases)

    def _call_spec(self, spec: object) -> SpecConfig:
        if spec is None:
            return self._spec
        _check_config("spec", spec, SpecConfig)
        return spec

    def _sync(self, sync_phases: object) -> bool:
        if sync_phases is None:
            return self.engine.sync_phases
        if not isinstance(sync_phases, bool):
            raise ValueError(f"sync_phases={short(sync_phases)} is invalid: pass True, False or "
                             "None (EngineConfig.sync_phases)")
        return sync_phases

    # _prepare and _run are what tests/test_mesh.py drives chunk by chunk (under a transfer
    # guard), below the public calls that collect whole outputs.
    def _prepare(self, prompts, sampling_params, chat):
        return self.prompts.prepare(prompts, sampling_params, chat)

    def _run(self, ids: list[list[int]], params: list[SamplingParams], mode: str,
             spec: SpecConfig | None = None, sync_phases: bool | None = None
             ) -> Iterator[tuple[list[list[int]], RunMetrics]]:
        """Yields (new tokens per real row, metrics) chunk by chunk."""
        stops = [self.prompts.stop_ids(p) for p in params]
        return self.core.run(ids, params, stops, mode, self._call_spec(spec),
                             self._sync(sync_phases))

    def _collect(self, ids, params, mode, spec, sync_phases) -> Iterator[_Progress]:
        """Per-row token lists grown chunk by chunk, cut at the stop token / stop string /
        budget, and per row its tokens' and its prompt's log-probabilities (None where the row
        did not ask)."""
        got = _Progress([[] for _ in ids], [None] * len(ids),
                        [None if p.logprobs is None else [] for p in params], [None] * len(ids),
                        [None] * len(ids))
        out, reason, lps = got.out, got.reason, got.lps
        stop_ids = [self.prompts.stop_ids(p) for p in params]
        stops = [set(s) for s in stop_ids]
        if self.core.continuous(params, stop_ids):
            # A row this loop has ended frees its slot for the next (continuous.py).
            chunks = self.core.run_continuous(ids, params, stop_ids, mode,
                                              self._call_spec(spec),
                                              lambda i: reason[i] is not None)
        else:
            chunks = self._run(ids, params, mode, spec, sync_phases)
        for toks, metrics in chunks:
            for i in range(len(ids)):
                before = len(out[i])
                for t in toks[i]:
                    if reason[i] is not None:
                        break
                    if isinstance(t, PromptLogprobs):
                        n = params[i].prompt_logprobs
                        if n is not None:
                            got.prompt_lps[i] = [None] + [
                                _entry(tok, chosen, top, n)
                                for tok, (chosen, top) in zip(ids[i][1:], t.entries)]
                        continue
                    if isinstance(t, tuple):  # (token, logprob, top): the batch asked
                        t, chosen, top = t
                        if lps[i] is not None:
                            n = params[i].logprobs
                            lps[i].append(_entry(t, chosen, top, n))
                    out[i].append(int(t))
                    if int(t) in stops[i]:
                        reason[i] = "stop"
                    elif len(out[i]) >= params[i].max_new_tokens:
                        reason[i] = "length"
                if params[i].stop and got.text[i] is None and len(out[i]) > before:
                    self._stop_strings(got, i, before, params[i])
            metrics.new_tokens = sum(len(o) for o in out)
            self.last_metrics = metrics
            yield got
            if (all(r is not None for r in reason) and any(t is not None for t in got.text)
                    and self.core.driver(mode) == "single"):
                # Rows ended on stop strings, which the programs do not see, may still be
                # decoding: closing the run stops them. Worker processes and a pod's other
                # processes would finish the request anyway (and the run's metrics come at
                # its end), so there the rest is read and left out.
                break
        self.core.learn(mode, metrics, greedy=all(p.temperature == 0 for p in params))

    def _stop_strings(self, got: _Progress, i: int, before: int, p: SamplingParams) -> None:
        """End row i at the first stop string its text holds, if any: its tokens up to the
        one that completed the string (the first of this chunk's after `before` whose text
        holds it), its text cut at the string."""
        out = got.out[i]
        text = stop_strings.cut(self.prompts.text(out), p.stop, p.include_stop_str_in_output)
        if text is None:
            return
        end = stop_strings.kept(out, before, self.prompts.text, p.stop)
        del out[end:]
        if got.lps[i] is not None:
            del got.lps[i][end:]
        got.reason[i], got.text[i] = "stop", text

    # ---------------------------------------------------------------- public API
    @no_type_check
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 *, chat: bool = True, mode: str | None = None, spec: SpecConfig | None = None,
                 sync_phases: bool | None = None) -> list[RequestOutput]:
        """Generate for prompts: one output per prompt, or n consecutive ones where its
        SamplingParams ask for n. More rows than EngineConfig.max_batch decode as one
        continuous batch of max_batch slots, a row joining as soon as another ends (with
        EngineConfig(continuous=False): consecutive batches of max_batch rows), with a
        progress bar (the LLM's `progress`).
        A row's answer is the same either way; a continuous run does not time its phases.
        Strings go through the chat template unless chat=False; token-id lists are used as
        they are. mode: "ar", "sd" or "ssd" (default: "sd" when a draft is loaded, else
        "ar"). spec: this call's speculation settings (None: the LLM's); sync_phases: block
        between draft and verify to time each phase (None: EngineConfig's)."""
        mode, spec, sync = self._call(mode, spec, sync_phases)
        ids, params = self._prepare(prompts, sampling_params, chat)
        size = self.engine.max_batch
        batches = [slice(lo, lo + size) for lo in range(0, len(ids), size)]
        for b in batches:  # every row fits before any runs: no answers lost to a late error
            check_fits(ids[b], params[b], mode, self.engine,
                       self.core.model_config.max_position_embeddings, spec.k or 0)
        if self.core.continuous(params, [self.prompts.stop_ids(p) for p in params]):
            batches = [slice(0, len(ids))]  # one continuous batch of max_batch slots
        bar = None
        if len(ids) > size and self.core.progress:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc=f"generate ({mode})", unit="answer",
                       file=sys.stderr)
        outs = []
        try:
            for b in batches:
                ended = 0
                for got in self._collect(ids[b], params[b], mode, spec, sync):
                    if bar is not None:
                        now = sum(r is not None for r in got.reason)
                        bar.update(now - ended)
                        ended = now
                metrics = self.last_metrics
                outs += [RequestOutput(t, got.out[i], got.final_text(i, self.prompts.text),
                                       got.reason[i] or "length", metrics, got.lps[i],
                                       got.prompt_lps[i]) for i, t in enumerate(ids[b])]
                if bar is not None:
                    bar.update(len(ids[b]) - ended)
        finally:
            if bar is not None:
                bar.close()
        return outs

    def fill_in_middle(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt (token ids, for `generate` / `stream`) for a code model
        trained for it (Qwen2.5-Coder): the answer is what goes between `prefix` and
        `suffix`. A tokenizer without FIM tokens is a ValueError naming the fix."""
        return self.prompts.fill_in_middle(prefix, suffix)

    @no_type_check
    def warmup(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               *, chat: bool = True, mode: str | None = None, spec: SpecConfig | None = None,
               sync_phases: bool | None = None) -> float:
        """Compile the programs a `generate` of these prompts will use (prefill and the decode
        step at the same shape buckets) by running its first chunk (of its first batch where
        there are more rows than max_batch; of a continuous batch, the first rows' joins and
        a round). Returns seconds spent."""
        t0 = time.perf_counter()
        mode, spec, sync = self._call(mode, spec, sync_phases)
        ids, params = self._prepare(prompts, sampling_params, chat)
        size = self.engine.max_batch
        stops = [self.prompts.stop_ids(p) for p in params]
        if self.core.continuous(params, stops):  # the first rows' joins and a round
            chunks = self.core.run_continuous(ids, params, stops, mode, spec, lambda i: False)
        else:
            chunks = self._run(ids[:size], params[:size], mode, spec, sync)
        for i, _ in enumerate(chunks):
            if i == 1:
                break
        chunks.close()
        return time.perf_counter() - t0

    @no_type_check
    def shapes(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               *, chat: bool = True, mode: str | None = None, spec: SpecConfig | None = None
               ) -> Shapes:
        """(padded batch, prompt bucket, cache length): the shapes a `generate` of these
        prompts compiles for. Two calls with equal shapes (and equal settings) share programs.
        With automatic settings (spec k=None) K is chosen as the run would choose it. More
        rows than max_batch: the continuous batch's (max_batch slots, the longest prompt's
        bucket, the cache of the longest row), or with consecutive batches the first's."""
        mode, spec, _ = self._call(mode, spec, None)
        ids, params = self.prompts.prepare(prompts, sampling_params, chat, draw_seeds=False)
        size = self.engine.max_batch
        if self.core.continuous(params, [self.prompts.stop_ids(p) for p in params]):
            return self.core.live_shapes(ids, params, mode, spec)
        return self.core.shapes(ids[:size], params[:size], mode, spec)

    @no_type_check
    def settings(self, mode: str | None = None, *, rows: int = 1,
                 spec: SpecConfig | None = None,
                 sampling_params: SamplingParams | None = None) -> tuple[SpecConfig, dict | None]:
        """The speculation settings a call of `rows` rows would run with, resolved now (with
        automatic settings: chosen as that call would choose them), and their description (K,
        budget, backup, and when chosen the speed model's prediction). Passing the resolved
        SpecConfig as `spec=` pins them: automatic choices follow the pair's learnt acceptance
        from call to call, so K may change between calls otherwise. `sampling_params`: the
        call's settings: its max_new_tokens sets the answer length the prediction counts
        rounds for, and for a sampled call SSD also chooses Saguaro's C."""
        mode, spec, _ = self._call(mode, spec, None)
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows={rows!r} is invalid: give the number of rows a call would "
                             "decode, 1 or more")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        return self.core.settings(mode, 1 << (rows - 1).bit_length(), spec, sampling_params)

    @no_type_check
    def stream(self, prompt: Prompt, sampling_params: SamplingParams = SamplingParams(),
               *, chat: bool = True, mode: str | None = None, spec: SpecConfig | None = None,
               sync_phases: bool | None = None) -> Iterator[str]:
        """Yield text pieces of one request as they are decoded."""
        if prompt_kind(prompt) is None:
            raise ValueError("stream() takes one prompt (text, token ids or chat messages); "
                             "use generate() for a batch")
        if isinstance(sampling_params, SamplingParams) and sampling_params.n != 1:
            raise ValueError(f"stream() gives one answer, not n={sampling_params.n}: use "
                             "generate() for several")
        mode, spec, sync = self._call(mode, spec, sync_phases)
        ids, params = self._prepare([prompt], sampling_params, chat)
        shown, stops = "", params[0].stop
        for got in self._collect(ids, params, mode, spec, sync):
            if got.reason[0] is not None:
                continue  # the row's last chunk: its final text follows
            # Hold back an incomplete character and a tail that may start a stop string.
            stable = stop_strings.shown(self.prompts.text(got.out[0]), stops)
            if len(stable) > len(shown):
                yield stable[len(shown):]
                shown = stable
        self.last_token_ids = list(got.out[0])  # of this stream, for callers that compare runs
        final = got.final_text(0, self.prompts.text)
        if len(final) > len(shown):
            yield final[len(shown):]
