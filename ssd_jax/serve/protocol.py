"""The OpenAI request and response shapes the server speaks, and their validation.

A request becomes a `Job` (prompt token ids, SamplingParams, stop strings, streaming flags,
log-probabilities asked for) or an `APIError` naming the field and the fix: fields the engine
does not support (best_of, tools ...) are refused, never silently ignored. Purely
informational fields (user, metadata) are accepted. Extensions, as in vLLM: `top_k`, `ignore_eos`,
`stop_token_ids`, `min_tokens`, `repetition_penalty`.

A completions request may hold several prompts (a list of strings or of token-id lists): `parse`
makes one job per prompt. `n` > 1 asks for several choices of each: `choices_of` makes one job
per choice, each a row of its own (sampled independently, as n requests would be); choice i of
prompt p has index p * n + i in the one response, as in OpenAI's API.

`echo` (completions) puts the prompt ahead of the answer, and with `logprobs` the prompt's own
log-probabilities ahead of the answer's (None for its first token, which nothing predicts):
what lm-evaluation-harness's log-likelihood tasks ask for, with max_tokens 0 or 1.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace

from ssd_jax.config import MAX_LOGPROBS, SamplingParams, choice_seed
from ssd_jax.core.live import BIAS_WIDTH  # logit_bias entries a request may give


class APIError(Exception):
    """An error response: HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                       kind, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class Job:
    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams  # with the request's stop strings (`stop`)
    stream: bool
    include_usage: bool
    # No max_tokens in the request: the server sets max_new_tokens to the context left after
    # the prompt (Server.check_fits), as vLLM and llama.cpp's server do.
    max_tokens_given: bool = True
    # Log-probabilities: None (not asked for) or how many top alternatives per token (0: the
    # chosen token's alone). Completions' `logprobs: N`; chat's `logprobs: true` +
    # `top_logprobs: N`.
    logprobs: int | None = None
    n: int = 1  # choices asked for; `choices_of` splits them into one job each
    index: int = 0  # this job's choice index in its response (its prompt's, before choices_of)
    echo: bool = False  # the prompt (and its log-probabilities) ahead of the answer
    # max_tokens 0 (with echo): the prompt alone. The row still runs its prefill, which
    # computes the prompt's log-probabilities, and leaves before its first token counts.
    prompt_only: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stream", "ignore_eos", "stop_token_ids", "min_tokens",
          "stream_options", "n", "user", "metadata", "logprobs", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logit_bias", "include_stop_str_in_output"}
FIELDS = {"completion": COMMON | {"prompt", "echo", "best_of", "suffix"},
          "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                            "tool_choice", "parallel_tool_calls", "response_format"}}
# Fields whose only supported value is "off": (field, the values that mean off).
OFF = {"best_of": (None, 1),
       "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
       "response_format": (None, {"type": "text"})}


def _number(body: dict, name: str, kind, default, low=None, high=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise APIError(400, f"'{name}' must be {'a number' if kind is float else 'an integer'}, "
                            f"got {v!r}", name)
    if (low is not None and v < low) or (high is not None and v > high):
        where = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise APIError(400, f"'{name}'={v} is out of range: it must be {where}", name)
    return kind(v)


def flag(body: dict, name: str, default: bool = False) -> bool:
    """A boolean field, or a 400 naming it."""
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be true or false, got {v!r}", name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
            and len(stop) <= 4):
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them",
                       "stop")
    return tuple(stop)


def text_content(messages):
    """Chat messages with OpenAI's content parts ([{"type": "text", "text": ...}, ...], what
    current clients send) joined into text, and an assistant turn's null content (one that
    called tools) as ""; anything else is left for the chat template's check."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in c):
                kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__
                                for p in c} - {"text"})
                raise APIError(400, f"messages[{i}].content has parts of type {kinds}: this "
                                    "server reads text parts only ({'type': 'text', 'text': "
                                    "...})", "messages")
            m = dict(m, content="".join(p["text"] for p in c))
        elif c is None and isinstance(m, dict) and m.get("role") == "assistant":
            m = dict(m, content="")
        out.append(m)
    return out


def parse(kind: str, body, *, model_name: str, encode, infill=None) -> list[Job]:
    """Validate a request body: one job per prompt (chat: one). `encode(prompt_or_messages,
    chat: bool) -> ids` may raise ValueError (an unusable prompt), reported as a 400 on the
    prompt field; so may `infill(prefix, suffix) -> ids`, a completion's fill-in-the-middle
    prompt (its `suffix`), on the suffix field. Without max_tokens a job's max_new_tokens is
    a placeholder (Job.max_tokens_given)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise APIError(400, f"unsupported field '{unknown[0]}': this server does not implement "
                            "it; remove it from the request", unknown[0])
    for name, off in OFF.items():
        if name in body and body[name] not in off:
            raise APIError(400, f"'{name}'={body[name]!r} is not supported by this server (only "
                                f"{' / '.join(repr(o) for o in off if o is not None)}); remove "
                                "it or use the default", name)
    model = body.get("model")
    if model is None:
        raise APIError(400, "'model' is required", "model")
    if model != model_name:
        raise APIError(404, f"model '{model}' does not exist: this server serves "
                            f"'{model_name}' (GET /v1/models)", "model", code="model_not_found")
    prompt_field = "prompt" if kind == "completion" else "messages"
    prompt = body.get(prompt_field)
    if prompt is None:
        raise APIError(400, f"'{prompt_field}' is required", prompt_field)
    # Several prompts: a list of strings or of token-id lists (the openai client sends a
    # one-element list for one string).
    several = kind == "completion" and isinstance(prompt, list) and bool(prompt) and all(
        isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if several else [text_content(prompt) if kind == "chat" else prompt]
    echo = kind == "completion" and flag(body, "echo")
    suffix = body.get("suffix") if kind == "completion" else None
    if suffix not in (None, ""):
        ids = _infill(prompts, suffix, echo, infill)
    else:
        try:
            ids = [encode(p, kind == "chat") for p in prompts]
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0], prompt_field)
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _number(body, max_name, int, None, 0)
    if max_tokens == 0 and not echo:
        raise APIError(400, f"'{max_name}'=0 asks for no answer, which only makes sense with "
                            "'echo': true (the prompt's log-probabilities): give 1 or more",
                       max_name)
    given = max_tokens is not None
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise APIError(400, "'stream_options' supports only include_usage", "stream_options")
    stream = flag(body, "stream")
    min_tokens = _number(body, "min_tokens", int, 0, 0)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise APIError(400, f"'seed' must be a non-negative integer, got {seed!r}", "seed")
    try:
        params = SamplingParams(
            temperature=_number(body, "temperature", float, 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
            top_k=_number(body, "top_k", int, 0, 0),
            min_p=_number(body, "min_p", float, 0.0, 0.0, 1.0),
            # Without max_tokens a placeholder (Server.check_fits sets the context left).
            max_new_tokens=max_tokens or max(1, min_tokens),
            seed=None if seed is None else seed % 2**32, min_tokens=min_tokens,
            ignore_eos=flag(body, "ignore_eos"), stop_token_ids=_token_ids(body),
            logit_bias=_logit_bias(body),
            presence_penalty=_number(body, "presence_penalty", float, 0.0, -2.0, 2.0),
            frequency_penalty=_number(body, "frequency_penalty", float, 0.0, -2.0, 2.0),
            repetition_penalty=_number(body, "repetition_penalty", float, 1.0),
            stop=_stop(body),
            include_stop_str_in_output=flag(body, "include_stop_str_in_output"))
    except ValueError as e:
        msg = str(e).splitlines()[0]
        raise APIError(400, msg, next((f for f in ("top_k", "top_p", "min_p", "temperature",
                                                   "min_tokens", "repetition_penalty")
                                       if msg.startswith(f + "=")), None))
    lp, n = _logprobs(kind, body), _number(body, "n", int, 1, 1)
    return [Job(kind, model, p, params, stream, bool(stream_options.get("include_usage")),
                given, logprobs=lp, n=n, index=i, echo=echo, prompt_only=max_tokens == 0)
            for i, p in enumerate(ids)]


def _infill(prompts: list, suffix, echo: bool, infill) -> list[list[int]]:
    """Completions' `suffix`: each text prompt is the prefix of a fill-in-the-middle prompt."""
    if not isinstance(suffix, str):
        raise APIError(400, f"'suffix' must be a string, got {suffix!r}", "suffix")
    if echo:
        raise APIError(400, "'echo' with 'suffix' is not supported: the answer goes between "
                            "prompt and suffix; drop one of them", "echo")
    if not all(isinstance(p, str) for p in prompts):
        raise APIError(400, "'suffix' needs text prompts (the code before the gap), not token "
                            "ids", "suffix")
    if infill is None:
        raise APIError(400, "this server does not fill in the middle: remove 'suffix'",
                       "suffix")
    try:
        return [infill(p, suffix) for p in prompts]
    except ValueError as e:
        raise APIError(400, str(e).splitlines()[0], "suffix")


def choices_of(job: Job) -> list[Job]:
    """One job per choice of a checked prompt's job (Server.check_fits gave it a seed): the
    same prompt and settings, index p * n + i for prompt p, and seed i of the job's (choice 0
    keeps the job's own seed, so n=1 and choice 0 of n=2 make the same text). Greedy choices
    are equal, as OpenAI's and vLLM's are."""
    seed = job.params.seed
    return [replace(job, index=job.index * job.n + i,
                    params=replace(job.params, seed=choice_seed(seed, i)))
            for i in range(job.n)]


def _token_ids(body: dict) -> tuple[int, ...]:
    """vLLM's `stop_token_ids`: token ids that end the answer as its end-of-text would."""
    ids = body.get("stop_token_ids") or []
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          and t >= 0 for t in ids)):
        raise APIError(400, f"'stop_token_ids' must be a list of token ids (non-negative "
                            f"integers), got {ids!r}", "stop_token_ids")
    return tuple(ids)


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": value in [-100, 100]} (JSON keys are strings)."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise APIError(400, f"'logit_bias' must be an object of token id -> bias, got {bias!r}",
                       "logit_bias")
    if len(bias) > BIAS_WIDTH:
        raise APIError(400, f"'logit_bias' has {len(bias)} entries: this server takes at most "
                            f"{BIAS_WIDTH}", "logit_bias")
    out = {}
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isdigit()) or isinstance(v, bool) \
                or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise APIError(400, f"'logit_bias' entry {k!r}: {v!r} is invalid: give token ids "
                                "(non-negative integers) mapped to numbers in [-100, 100]",
                           "logit_bias")
        out[int(k)] = float(v)
    return out


def _logprobs(kind: str, body: dict) -> int | None:
    """What the request asks for: None, or the number of top alternatives per token."""
    if kind == "completion":
        if body.get("logprobs") is False:
            return None
        return _number(body, "logprobs", int, None, 0, MAX_LOGPROBS)
    top = _number(body, "top_logprobs", int, None, 0, MAX_LOGPROBS)
    if body.get("logprobs") is None or not flag(body, "logprobs"):
        if top is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


# ------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


def choice(job: Job, text: str | None, finish_reason: str | None, delta: bool,
           logprobs: dict | None = None) -> dict:
    i = job.index
    if job.kind == "completion":
        return dict(index=i, text=text or "", logprobs=logprobs, finish_reason=finish_reason)
    if delta:
        return dict(index=i, delta={} if text is None else {"role": "assistant", "content": text},
                    logprobs=logprobs, finish_reason=finish_reason)
    return dict(index=i, message={"role": "assistant", "content": text}, logprobs=logprobs,
                finish_reason=finish_reason)


def merged_speculation(specs: list[dict]) -> dict:
    """One response's speculation statistics over its choices' rows (Scheduler.speculation's
    keys): counts add up, rates are over all rounds."""
    if len(specs) == 1:
        return specs[0]
    out = dict(specs[0], rounds=sum(s["rounds"] for s in specs))
    rounds = max(out["rounds"], 1)
    for key in ("drafted_tokens", "accepted_tokens", "backup_rounds"):
        if key in out:
            out[key] = sum(s[key] for s in specs)
    if "accepted_tokens" in out:
        out["mean_accepted_length"] = out["accepted_tokens"] / rounds
    if "backup_rounds" in out:
        out["cache_hit_rate"] = (out["rounds"] - out["backup_rounds"]) / rounds
    return out


def logprobs_object(job: Job, entries: list, piece) -> dict | None:
    """A choice's `logprobs` in the shape of the job's endpoint, from scheduler.LogprobEntry's
    (None when the job did not ask). `piece(id) -> (text, bytes)`: a token's own text.

    chat: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]};
    completions (the legacy shape): {tokens, token_logprobs, top_logprobs: [{text: logprob}]
    with the chosen token among them, text_offset}; an echoed prompt's first token has None
    for both, as nothing predicts it."""
    if job.logprobs is None:
        return None
    n = job.logprobs

    def one(tok: int, lp: float) -> dict:
        text, raw = piece(tok)
        return dict(token=text, logprob=_finite(lp), bytes=list(raw))
    if job.kind == "chat":
        return dict(content=[dict(one(e.token, e.logprob),
                                  top_logprobs=[one(t, lp) for t, lp in e.top[:n]])
                             for e in entries], refusal=None)
    tops: list[dict | None] = []
    for e in entries:
        if e.top is None:
            tops.append(None)
            continue
        top = {piece(t)[0]: _finite(lp) for t, lp in e.top[:n]}
        top.setdefault(piece(e.token)[0], _finite(e.logprob))
        tops.append(top)
    return dict(tokens=[piece(e.token)[0] for e in entries],
                token_logprobs=[_finite(e.logprob) for e in entries], top_logprobs=tops,
                text_offset=[e.text_offset for e in entries])


def _finite(lp: float | None) -> float | None:
    """JSON has no -inf: a token the model gives no mass (a masked logit) reads as -9999.0, as
    OpenAI writes it."""
    return None if lp is None else max(float(lp), -9999.0)


def envelope(job: Job, choices: list, chunk: bool, **extra) -> dict:
    obj = ("text_completion" if job.kind == "completion" else
           "chat.completion.chunk" if chunk else "chat.completion")
    prefix = "cmpl" if job.kind == "completion" else "chatcmpl"
    return dict(id=f"{prefix}-{job.id}", object=obj, created=job.created, model=job.model,
                choices=choices, **extra)
