"""The HTTP surface: OpenAI's /v1/completions and /v1/chat/completions (plain JSON or server-sent
events ending in `data: [DONE]`), /v1/models, /health and /metrics, and vLLM's /tokenize,
/detokenize and /tokenizer_info, on Starlette (the ASGI
toolkit FastAPI is built on; we need routing and streaming responses, not FastAPI's schema
layer, and validation lives in protocol.py where its errors can name OpenAI's fields)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ssd_jax.serve import protocol
from ssd_jax.serve.protocol import APIError
from ssd_jax.serve.scheduler import Request


DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is there


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _cancel(reqs: list) -> None:
    for req in reqs:
        req.cancel()


def _prompt_tokens(reqs: list) -> int:
    """usage.prompt_tokens: each prompt's tokens once, however many choices it has."""
    return sum(len(r.job.prompt_ids) for r in reqs if r.job.index % r.job.n == 0)


class RequireKey:
    """`--api-key`: the /v1 routes answer 401 to a request without `Authorization: Bearer
    <key>`, as vLLM's and llama.cpp's servers do (the openai client's `api_key` sends it);
    /health, /metrics and the tokenizer routes stay open, for probes and lm-eval's remote
    tokenizer. Compared in constant time."""

    def __init__(self, app, key: str):
        self.app, self.want = app, b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.want):
                what = "a wrong API key" if got else "no API key"
                e = APIError(401, f"this server needs its API key and the request sent {what}: "
                                  "send 'Authorization: Bearer <key>' (the openai client's "
                                  "api_key=)", kind="authentication_error",
                             code="invalid_api_key")
                return await _error(e)(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(server, api_key: str | None = None) -> Starlette:
    """`server`: a serve.server.Server (model name, encode, stop ids, scheduler, metrics).
    `api_key`: the key the /v1 routes require (RequireKey); None: open."""

    async def body_of(http: HTTPRequest):
        try:
            return json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}")

    def tokenizer_route(call):
        async def route(http: HTTPRequest):
            try:
                return JSONResponse(call(await body_of(http)) if http.method == "POST"
                                    else call())
            except APIError as e:
                return _error(e)
        return route

    async def submit(kind: str, http: HTTPRequest):
        """Parse, check and queue a request: its choices' Requests (one per prompt and `n`, in
        the order of their indices) and the one queue their events arrive on as (choice index,
        event); or an error response."""
        try:
            body = await body_of(http)
            jobs = protocol.parse(kind, body, model_name=server.model_name,
                                  encode=server.encode, infill=server.llm.fill_in_middle)
            server.check_request(jobs)
        except APIError as e:
            return None, None, _error(e)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def pusher(i: int):
            return lambda ev: loop.call_soon_threadsafe(events.put_nowait, (i, ev))
        reqs = [Request(j, pusher(j.index), server.stop_ids(j.params))
                for job in jobs for j in protocol.choices_of(job)]
        try:
            server.scheduler.submit(*reqs)
        except APIError as e:
            return None, None, _error(e)
        return reqs, events, None

    async def completions(http: HTTPRequest):
        return await handle("completion", http)

    async def chat(http: HTTPRequest):
        return await handle("chat", http)

    async def handle(kind: str, http: HTTPRequest):
        reqs, events, error = await submit(kind, http)
        if error is not None:
            return error
        if reqs[0].job.stream:
            return StreamingResponse(stream(reqs, events), media_type="text/event-stream")
        n = len(reqs)
        text, entries, last = [[] for _ in reqs], [[] for _ in reqs], [None] * n
        asked = [time.monotonic()]
        try:
            while None in last:
                got = await next_event(reqs, events, http, asked)
                if got is None:  # the client went away: its rows are freed at the next round
                    return Response(status_code=499)
                i, ev = got
                if ev[0] == "delta":
                    text[i].append(ev[1])
                    entries[i] += ev[2]
                    continue
                last[i] = ev
                if ev[0] == "error":
                    _cancel(reqs)
                    return _error(APIError(500, ev[1], kind="server_error"))
        except asyncio.CancelledError:
            _cancel(reqs)
            raise
        choices = []
        for req, t, e, (_, reason, _, _, rest) in zip(reqs, text, entries, last):
            lp = protocol.logprobs_object(req.job, e + rest, server.piece)
            choices.append(protocol.choice(req.job, "".join(t), reason, delta=False,
                                           logprobs=lp))
        return JSONResponse(protocol.envelope(
            reqs[0].job, choices, chunk=False,
            usage=protocol.usage(_prompt_tokens(reqs), sum(ev[2] for ev in last)),
            speculation=protocol.merged_speculation([ev[3] for ev in last])))

    async def next_event(reqs: list, events: asyncio.Queue, http: HTTPRequest, asked: list):
        """The next (choice, event) for a non-streamed request, or None once its client has
        gone (a plain response only learns that by asking, every DISCONNECT_POLL_S: nothing is
        written until the end, and deltas arrive every round). `asked`: [when it last asked]."""
        while True:
            if time.monotonic() - asked[0] >= DISCONNECT_POLL_S:
                asked[0] = time.monotonic()
                if await http.is_disconnected():
                    _cancel(reqs)
                    return None
            try:
                return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass

    async def stream(reqs: list, events: asyncio.Queue):
        """Server-sent events: each chunk carries one choice's delta, tagged with its index;
        the usage chunk (when asked for) follows the last choice's end."""
        job = reqs[0].job

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if job.kind == "chat":  # the role comes first, as OpenAI's streams do
                for req in reqs:
                    yield sse(protocol.envelope(job, [dict(
                        index=req.job.index, delta={"role": "assistant", "content": ""},
                        logprobs=None, finish_reason=None)], chunk=True))
            left, tokens = len(reqs), 0
            while left:
                i, ev = await events.get()
                j = reqs[i].job
                if ev[0] == "delta":
                    choice = protocol.choice(j, ev[1], None, delta=True, logprobs=(
                        protocol.logprobs_object(j, ev[2], server.piece)))
                    if j.kind == "chat":
                        choice["delta"] = {"content": ev[1]}
                    yield sse(protocol.envelope(job, [choice], chunk=True))
                    continue
                if ev[0] == "error":
                    yield sse(APIError(500, ev[1], kind="server_error").body())
                    break
                _, reason, n_tokens, spec, rest = ev
                last = protocol.choice(j, None if j.kind == "chat" else "", reason,
                                       delta=True, logprobs=(
                                           protocol.logprobs_object(j, rest, server.piece)))
                yield sse(protocol.envelope(job, [last], chunk=True, speculation=spec))
                left, tokens = left - 1, tokens + n_tokens
            if not left and job.include_usage:
                yield sse(protocol.envelope(job, [], chunk=True, usage=protocol.usage(
                    _prompt_tokens(reqs), tokens)))
            yield "data: [DONE]\n\n"
        finally:
            _cancel(reqs)  # a client that went away frees its slots; after "done" a no-op

    async def models(_: HTTPRequest):
        return JSONResponse({"object": "list", "data": [dict(
            id=server.model_name, object="model", created=server.created, owned_by="ssd-jax")]})

    async def health(_: HTTPRequest):
        ok = server.scheduler.error is None
        return JSONResponse({"status": "ok" if ok else "failed", "mode": server.mode,
                             "slots": server.slots, "k": server.spec.k,
                             "budget": server.spec.budget}, status_code=200 if ok else 503)

    async def metrics(_: HTTPRequest):
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(http: HTTPRequest, exc):
        return _error(APIError(404, f"no route {http.method} {http.url.path}: see /v1/models, "
                                    "/v1/completions, /v1/chat/completions, /health, /metrics, "
                                    "/tokenize, /detokenize, /tokenizer_info"))

    async def wrong_method(http: HTTPRequest, exc):
        allowed = (getattr(exc, "headers", None) or {}).get("Allow", "")
        e = APIError(405, f"{http.url.path} does not take {http.method}"
                          f"{f': use {allowed}' if allowed else ''}")
        return JSONResponse(e.body(), status_code=405,
                            headers={"Allow": allowed} if allowed else None)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        server.shutdown()  # Ctrl-C / SIGTERM: uvicorn stops taking requests, then this

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenizer_route(server.tokenize), methods=["POST"]),
        Route("/detokenize", tokenizer_route(server.detokenize), methods=["POST"]),
        Route("/tokenizer_info", tokenizer_route(server.tokenizer_info), methods=["GET"]),
    ], exception_handlers={404: not_found, 405: wrong_method}, lifespan=lifespan,
        middleware=[] if api_key is None else [Middleware(RequireKey, key=api_key)])
