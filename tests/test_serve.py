"""The OpenAI-compatible server (ssd_jax.serve): the official `openai` client against a server
started in this process on the loopback address, SmolLM2 with its distilled draft in SSD mode.
Greedy text equals offline generate; staggered requests join a running batch; a disconnected
stream frees its row; bad requests are 400s, a full queue a 429."""
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

from ssd_jax.serve.protocol import APIError, parse

MODEL = "smollm2"
PROMPTS = ["What is the capital of France?", "Name three colors.", "Count from one to five.",
           "Write a haiku about rain.", "What is 2 + 2?", "Say hello.", "Name a fruit.",
           "What day comes after Monday?"]


def _bound_socket() -> socket.socket:
    """A loopback socket bound to a free port, handed to uvicorn (no window in which another
    process could take the port)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


@pytest.fixture(scope="module")
def served():
    import uvicorn
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    from ssd_jax.serve.app import build_app
    from ssd_jax.serve.server import Server
    llm = LLM(MODEL, draft="smollm2-draft", spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=512, driver="single"))
    # Offline references, each request alone (greedy AR: SSD's output is the same by design),
    # for the (chat, prompt) pairs the tests ask.
    want = {}
    for chat, i in ((False, 3), (True, 3), (True, 1)):
        p, n = PROMPTS[i], 6 + 3 * i
        out = llm.generate(p, SamplingParams(max_new_tokens=n), mode="ar", chat=chat)[0]
        want[chat, p] = (out.text, n, len(out.token_ids))
    for i, p in enumerate(PROMPTS):  # fixed lengths (EOS ignored), for the timing test
        n = 16 + 4 * i
        out = llm.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True), mode="ar")[0]
        want["long", p] = (out.text, n, n)
    server = Server(llm, mode="ssd", model_name=MODEL, slots=4, max_queue=8)
    sock = _bound_socket()
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not uv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield server, f"http://127.0.0.1:{port}", want
    uv.should_exit = True
    thread.join(30)
    assert not server.scheduler._thread.is_alive()  # shutdown stopped the decode thread


def _client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_client_completions_and_chat_equal_offline(served):
    server, url, want = served
    client = _client(url)
    p = PROMPTS[3]
    text, n, used = want[False, p]
    assert text  # a prompt whose plain completion is not an immediate end of text
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0)
    assert r.choices[0].text == text and r.usage.completion_tokens == used
    spec = r.model_extra["speculation"]
    assert spec["mode"] == "ssd" and spec["rounds"] >= 1 and 0 <= spec["cache_hit_rate"] <= 1
    chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    text, n, used = want[True, p]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                       max_tokens=n, temperature=0)
    assert r.choices[0].message.content == text
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=n, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == used
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_stop_strings_cut_the_text_across_tokens(served):
    """A stop string taken from the middle of the reference answer (so it spans tokens, or
    sits inside one): the text ends right before it, finish_reason "stop", streamed or not."""
    server, url, want = served
    client = _client(url)
    text, n, _ = want["long", PROMPTS[3]]
    stop = text[9:13]
    cut = text[:text.find(stop)]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=n,
              temperature=0, stop=[stop, "never appears"], extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # The answer's tokens end with the one that completed the string, as offline; vLLM's
    # include_stop_str_in_output keeps the string.
    from ssd_jax import SamplingParams
    offline = server.llm.generate(PROMPTS[3], SamplingParams(
        max_new_tokens=n, ignore_eos=True, stop=stop), mode="ar")[0]
    assert offline.text == cut and r.usage.completion_tokens == len(offline.token_ids)
    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == cut + stop


def test_staggered_requests_join_a_running_batch(served):
    """Eight requests of different lengths, arriving 0.05 s apart into 4 slots: each equals its
    offline output alone, and requests join while others decode (never waiting for the batch
    to drain)."""
    server, url, want = served
    client = _client(url)
    results, first = {}, len(server.scheduler.events)

    def ask(p):
        text, n, _ = want["long", p]
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True})
        results[p] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(300)
    assert results == {p: want["long", p][0] for p in PROMPTS}
    events = server.scheduler.events[first:]
    joins = {job: t for t, kind, job, _ in events if kind == "join"}
    leaves = {job: t for t, kind, job, _ in events if kind == "leave"}
    assert len(joins) == len(leaves) == len(PROMPTS)
    order = sorted(joins, key=joins.get)
    # Four slots: the first four ran side by side; every later request joined while another
    # was still decoding (it took a freed slot at a round boundary; no drain-and-refill).
    assert max(joins[j] for j in order[:4]) < min(leaves.values())
    for j in order[4:]:
        assert any(joins[i] < joins[j] < leaves[i] for i in joins if i != j), j


def test_disconnect_frees_the_row_and_bad_requests_are_400(served):
    import httpx
    server, url, want = served
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.time() + 30
    while server.scheduler.active:
        assert time.time() < deadline, "the disconnected request kept its row"
        time.sleep(0.05)
    text, n, _ = want[True, PROMPTS[1]]
    r = _client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=n,
        temperature=0)
    assert r.choices[0].message.content == text
    for payload, status, needle in [
            (b"{not json", 400, "not valid JSON"),
            (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "does not exist"),
            (json.dumps({"model": MODEL, "prompt": "x", "best_of": 2}).encode(), 400,
             "'best_of'=2"),
            (json.dumps({"model": MODEL, "prompt": "x", "n": 9}).encode(), 400, "'n'=9"),
            (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400,
             "'temperature'=-1"),
            (json.dumps({"model": MODEL, "prompt": "x", "logprobs": 21}).encode(), 400,
             "'logprobs'=21"),
            (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**6}).encode(), 400,
             "context")]:
        r = httpx.post(url + "/v1/completions", content=payload, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    # A top_k past int32 is a 400 on top_k, not a decode loop that dies with its neighbours.
    r = httpx.post(url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "top_k": 2**31})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    assert httpx.get(url + "/health").json()["status"] == "ok"
    r = httpx.get(url + "/v1/completions", timeout=30)  # OpenAI's JSON error, not plain text
    assert r.status_code == 405 and "use POST" in r.json()["error"]["message"], r.text
    # A non-streamed client that hangs up frees its row too (nothing is written to it until
    # the end, so the server asks whether it is still there).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", timeout=3, json=dict(body, stream=False,
                                                                  ignore_eos=True))
    deadline = time.time() + 30
    while server.scheduler.active or server.scheduler.pending:
        assert time.time() < deadline, "the non-streamed request kept its row"
        time.sleep(0.05)


def test_logprobs_with_the_openai_client(served):
    """logprobs / top_logprobs: one entry per completion token whose bytes spell the text,
    top alternatives sorted with the greedy choice first, the same streamed or not, in chat's
    and completions' shapes (the numbers themselves: tests/test_logprobs.py)."""
    server, url, want = served
    client = _client(url)
    text, n, _ = want["long", PROMPTS[3]]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=n,
              temperature=0, extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == text  # asking for logprobs changes no token
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == n
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text
    for e in entries:
        top = e.top_logprobs
        assert len(top) == 2 and top[0].logprob >= top[1].logprob and e.logprob <= 0
        assert (top[0].token, top[0].logprob) == (e.token, pytest.approx(e.logprob, abs=1e-6))
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in entries]
    # Completions' legacy shape, cut by a stop string: still one entry per counted token.
    stop = text[9:13]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=n, temperature=0,
                                  logprobs=1, stop=[stop])
    lp, out = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens).startswith(out) and lp.text_offset[0] == 0
    assert all(len(t) <= 2 and max(t.values()) <= 0 for t in lp.top_logprobs)
    offsets = [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    # What the server cannot give is a 400 naming the field.
    for body, needle in [({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                          "needs 'logprobs': true"),
                         ({"prompt": "x", "logprobs": 21}, "'logprobs'=21")]:
        kind = "chat" if "messages" in body else "completion"
        with pytest.raises(APIError) as e:
            parse(kind, {"model": MODEL, **body}, model_name=MODEL, encode=server.encode)
        assert needle in e.value.message
    job, = parse("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "logprobs": True, "top_logprobs": 3}, model_name=MODEL,
                 encode=server.encode)
    server.max_logprobs, keep = 2, server.max_logprobs
    try:
        with pytest.raises(APIError) as e:
            server.check_fits(job)
        assert "--max-logprobs" in e.value.message and e.value.param == "top_logprobs"
    finally:
        server.max_logprobs = keep


def test_echo_and_prompt_logprobs_as_lm_eval_asks(served):
    """Completions' echo: the prompt ahead of the answer and, with logprobs, the prompt's own
    log-probabilities (None for its first token), as lm-evaluation-harness's log-likelihood
    requests ask (token-id prompts, echo, logprobs 1, max_tokens 1; or 0). An answer's tokens
    echoed back score as they scored while they were decoded: the prefill's program against
    the SSD rounds'."""
    import httpx
    server, url, _ = served
    client, prompts = _client(url), server.llm.prompts
    p = PROMPTS[6]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    answer = _offline(server, p, 10).token_ids
    assert r.choices[0].text == prompts.text(answer)
    ctx = prompts.encode(p, chat=False)
    whole = ctx + answer
    e = client.completions.create(model=MODEL, prompt=[whole], echo=True, logprobs=1,
                                  max_tokens=0, temperature=0)
    lp = e.choices[0].logprobs
    assert e.choices[0].text == prompts.text(whole) and e.choices[0].finish_reason == "length"
    assert (e.usage.prompt_tokens, e.usage.completion_tokens) == (len(whole), 0)
    assert len(lp.tokens) == len(whole) and "".join(lp.tokens) == prompts.text(whole)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(whole))]
    np.testing.assert_allclose(lp.token_logprobs[len(ctx):], r.choices[0].logprobs.token_logprobs,
                               atol=1e-4)
    # lm-eval's reading: the continuation's sum, and whether each token was the greedy one.
    assert all(v == max(top.values()) for v, top in zip(lp.token_logprobs[len(ctx):],
                                                        lp.top_logprobs[len(ctx):]))
    # max_tokens 1 (lm-eval's request): the prompt's entries, then the answer's first token.
    one = client.completions.create(model=MODEL, prompt=[ctx], echo=True, logprobs=1,
                                    max_tokens=1, temperature=0).choices[0]
    assert one.text == prompts.text(ctx + answer[:1]) and len(one.logprobs.tokens) == len(ctx) + 1
    np.testing.assert_allclose(one.logprobs.token_logprobs[1:], lp.token_logprobs[1:len(ctx) + 1],
                               atol=1e-4)
    # Streamed: the prompt is the first delta; without logprobs, echo is the text alone.
    chunks = list(client.completions.create(model=MODEL, prompt=p, echo=True, max_tokens=10,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == p
    assert "".join(c.choices[0].text for c in chunks) == p + r.choices[0].text
    for body, field in [({"prompt": p, "max_tokens": 0}, "max_tokens"),
                        ({"messages": [{"role": "user", "content": p}], "echo": True}, "echo")]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        bad = httpx.post(url + path, timeout=30, json={"model": MODEL, **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text


def test_several_prompts_in_one_request(served):
    """A completions prompt that is a list of prompts (strings or token-id lists): one choice
    per prompt and n, index p * n + i, each its own row; usage counts each prompt once."""
    server, url, want = served
    client = _client(url)
    a, b = PROMPTS[0], PROMPTS[2]
    r = client.completions.create(model=MODEL, prompt=[a, server.llm.prompts.encode(b, chat=False)],
                                  max_tokens=12, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    alone = [client.completions.create(model=MODEL, prompt=q, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}) for q in (a, b)]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens
    assert r.usage.completion_tokens == 48
    with pytest.raises(APIError) as e:  # 3 prompts x 3 choices: more than the queue of 8
        server.check_request(parse("completion", {"model": MODEL, "prompt": [a] * 3, "n": 3},
                                   model_name=MODEL, encode=server.encode))
    assert e.value.param == "prompt" and "--max-queue" in e.value.message


def test_n_choices_are_rows_of_their_own(served):
    """n > 1: one response with n choices, each decoded as a row of its own. Greedy choices
    equal offline greedy; sampled choice i equals the request alone with the request's seed
    derived for i (choice 0 keeps the seed itself), streamed or not; usage counts them all."""
    from ssd_jax.serve.protocol import choices_of
    server, url, want = served
    client = _client(url)
    text, n, used = want["long", PROMPTS[4]]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[4]}], max_tokens=n,
        temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [(c.index, c.message.content) for c in r.choices] == [(0, text), (1, text)]
    assert r.usage.completion_tokens == 2 * n
    assert r.model_extra["speculation"]["rounds"] >= 2
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[5]}], max_tokens=8,
              temperature=0.9, seed=11, n=3, extra_body={"ignore_eos": True})
    job, = parse("chat", {k: v for k, v in kw.items() if k != "extra_body"}, model_name=MODEL,
                 encode=server.encode)
    seeds = [j.params.seed for j in choices_of(job)]
    assert seeds[0] == 11 and len(set(seeds)) == 3
    # A sampled row's draws are a function of its seed alone (whatever runs beside it:
    # tests/test_live.py), so choice i is the request with n=1 and choice i's seed.
    alone = [client.chat.completions.create(**dict(kw, n=1, seed=s)).choices[0].message.content
             for s in seeds]
    assert len(set(alone)) > 1  # the choices are different draws
    r = client.chat.completions.create(**kw)
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == alone
    assert r.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(stream=True, stream_options={
        "include_usage": True}, **kw))
    streamed = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == alone and chunks[-1].usage.completion_tokens == 24
    assert sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason) == [0, 1, 2]


def _offline(server, p: str, n: int, **kw):
    """Offline greedy AR of completion prompt `p`, n tokens, EOS ignored, with `kw`'s
    SamplingParams: what the server must answer."""
    from ssd_jax import SamplingParams
    return server.llm.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True, **kw),
                               mode="ar", chat=False)[0]


def test_a_suffix_needs_fill_in_the_middle_tokens(served):
    """Completions' suffix on a model without FIM tokens (SmolLM2): a 400 naming the fix."""
    import httpx
    _, url, _ = served
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "def f(x):",
                                                  "suffix": "\n    return y", "max_tokens": 4})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "suffix", r.text
    assert "no fill-in-the-middle tokens" in err["message"] and "qwen2.5-coder" in err["message"]


def test_stop_token_ids_end_the_answer(served):
    """vLLM's stop_token_ids: the answer ends at the first of them (included, as offline
    generate includes a stop token), finish_reason "stop"; ids past the vocabulary are a 400."""
    import httpx
    server, url, want = served
    p = PROMPTS[3]
    _, n, _ = want["long", p]
    ids = _offline(server, p, n).token_ids
    stop = ids[5]
    cut = ids[:ids.index(stop) + 1]
    r = _client(url).completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                        extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(cut)
    assert r.choices[0].text == server.llm.prompts.text(cut)
    for bad in ([10**7], [-1], "2"):
        r = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": p, "max_tokens": 2, "stop_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text


def test_logit_bias_moves_the_answer(served):
    """OpenAI's logit_bias: the served answer equals offline generate with the same bias (a
    banned token that greedy would pick, a favoured one); bad entries are 400s naming it."""
    import httpx
    server, url, want = served
    p = PROMPTS[5]
    _, n, _ = want["long", p]
    plain = _offline(server, p, n).token_ids
    bias = {plain[0]: -100.0, next(t for t in plain if t != plain[0]): 2.0}
    offline = _offline(server, p, n, logit_bias=bias)
    assert offline.token_ids != plain and plain[0] not in offline.token_ids
    r = _client(url).completions.create(
        model=MODEL, prompt=p, max_tokens=n, temperature=0,
        logit_bias={str(t): v for t, v in bias.items()}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == offline.text
    for bad in ({"x": 1}, {"5": 101}, {"5": True}, [1], {str(i): 1 for i in range(65)},
                {str(10**7): 1}):
        e = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": p, "max_tokens": 2, "logit_bias": bad})
        assert e.status_code == 400 and e.json()["error"]["param"] == "logit_bias", e.text


def test_penalties_are_served(served):
    """OpenAI's presence_penalty and frequency_penalty, vLLM's repetition_penalty: the served
    answer equals offline generate with the same penalties (exactness: tests/test_penalties.py);
    values out of range are 400s naming the field."""
    import httpx
    server, url, want = served
    p = PROMPTS[5]
    _, n, _ = want["long", p]
    pen = dict(presence_penalty=0.8, frequency_penalty=1.1, repetition_penalty=1.3)
    offline = _offline(server, p, n, **pen)
    assert offline.token_ids != _offline(server, p, n).token_ids
    r = _client(url).completions.create(
        model=MODEL, prompt=p, max_tokens=n, temperature=0, presence_penalty=0.8,
        frequency_penalty=1.1, extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert r.choices[0].text == offline.text
    for field, bad in [("presence_penalty", 2.5), ("frequency_penalty", "1"),
                       ("repetition_penalty", 0), ("repetition_penalty", -1.0)]:
        e = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": p, "max_tokens": 2, field: bad})
        assert e.status_code == 400 and e.json()["error"]["param"] == field, e.text


def test_tokenizer_endpoints_as_vllm_has_them(served):
    """POST /tokenize (text or chat messages), POST /detokenize, GET /tokenizer_info: the
    server's own tokenizer, as completions and chat encode; bad bodies are 400s."""
    import httpx
    server, url, _ = served
    prompts = server.llm.prompts
    text = "Hello, world! 1234"
    r = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == prompts.tokenizer.encode(text, add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    messages = [{"role": "user", "content": PROMPTS[0]}]
    r = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == prompts.encode(messages, chat=True)
    r = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert PROMPTS[0] in r["prompt"]
    info = httpx.get(url + "/tokenizer_info").json()
    eos = prompts.tokenizer.eos_token_ids[0]
    assert httpx.post(url + "/tokenize", json={"prompt": info["eos_token"],
                                               "add_special_tokens": False}).json()["tokens"] == [eos]
    assert info["chat_template"] == prompts.tokenizer.chat_template
    for path, body, field in [("/tokenize", {}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "bogus"}]}, "messages"),
                              ("/detokenize", {"tokens": [10**7]}, "tokens"),
                              ("/detokenize", {"tokens": "12"}, "tokens")]:
        e = httpx.post(url + path, json=body)
        assert e.status_code == 400 and e.json()["error"]["param"] == field, e.text


def test_min_tokens_holds_the_stop_back(served):
    """vLLM's min_tokens: a stop token id the answer would end at is held back for the first
    min_tokens tokens, as offline generate does; more than max_tokens is a 400 naming it."""
    import httpx
    server, url, want = served
    p = PROMPTS[3]
    _, n, _ = want["long", p]
    ids = _offline(server, p, n).token_ids
    stop = ids[2]
    offline = _offline(server, p, n, stop_token_ids=(stop,), min_tokens=6)
    assert stop not in offline.token_ids[:6] and offline.token_ids != ids[:3]
    r = _client(url).completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True, "min_tokens": 6,
                                                    "stop_token_ids": [stop]})
    assert r.choices[0].text == offline.text
    assert r.usage.completion_tokens == len(offline.token_ids)
    e = httpx.post(url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": p, "max_tokens": 2, "min_tokens": 3})
    assert e.status_code == 400 and e.json()["error"]["param"] == "min_tokens", e.text


def test_requests_without_max_tokens_get_the_context_left(served):
    """As vLLM's and llama.cpp's servers: no max_tokens means up to the end of the context;
    a prompt that leaves no room is a 400 on the prompt, in the server's own terms."""
    server, _, _ = served
    job, = parse("completion", {"model": MODEL, "prompt": PROMPTS[0]}, model_name=MODEL,
                 encode=server.encode)
    server.check_fits(job)
    slack = server.spec.k + 1
    assert job.params.max_new_tokens == 512 - slack - len(job.prompt_ids)
    long, = parse("completion", {"model": MODEL, "prompt": list(range(1, 510))},
                  model_name=MODEL, encode=server.encode)
    with pytest.raises(APIError) as e:
        server.check_fits(long)
    assert e.value.param == "prompt" and "--max-seq-len" in e.value.message
    capped, = parse("completion", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 600},
                    model_name=MODEL, encode=server.encode)
    with pytest.raises(APIError) as e:
        server.check_fits(capped)
    assert e.value.param == "max_tokens" and "max_new_tokens" not in e.value.message


def test_full_queue_is_429(served):
    import httpx
    server, url, _ = served
    server.scheduler.max_queue, body = 1, {"model": MODEL, "prompt": PROMPTS[2],
                                            "max_tokens": 300, "temperature": 0, "stream": True,
                                            "ignore_eos": True}  # no row ends early
    streams = []

    def until(active: int, pending: int) -> None:
        deadline = time.time() + 60
        while (len(server.scheduler.active), len(server.scheduler.pending)) != (active, pending):
            assert time.time() < deadline, (server.scheduler.active, server.scheduler.pending)
            time.sleep(0.01)
    try:
        with httpx.Client(timeout=60) as http:
            for i in range(5):  # 4 slots, then one waiting; each in its place before the next
                streams.append(http.stream("POST", url + "/v1/completions", json=body))
                assert streams[-1].__enter__().status_code == 200
                until(min(i + 1, 4), max(i - 3, 0))
            r = http.post(url + "/v1/completions", json=dict(body, stream=False))
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        server.scheduler.max_queue = 8
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert "ssd_jax_running_rows" in httpx.get(url + "/metrics").text


def test_protocol_refuses_what_it_does_not_support():
    enc = lambda p, chat: [1, 2, 3]  # noqa: E731
    job, = parse("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          "stop": ["\n\n", "END"], "max_completion_tokens": 5, "top_k": 3,
                          "seed": 7, "min_p": 0.05}, model_name="m", encode=enc)
    assert job.params.stop == ("\n\n", "END") and job.params.max_new_tokens == 5
    assert job.params.min_p == 0.05
    # Completions' suffix: each text prompt is a fill-in-the-middle prefix.
    fim = lambda prefix, suffix: [7, len(prefix), 8, len(suffix), 9]  # noqa: E731
    jobs = parse("completion", {"model": "m", "prompt": ["ab", "abc"], "suffix": "xyz"},
                 model_name="m", encode=enc, infill=fim)
    assert [j.prompt_ids for j in jobs] == [[7, 2, 8, 3, 9], [7, 3, 8, 3, 9]]
    for body, field, infill in [({"suffix": 3}, "suffix", fim),
                                ({"suffix": "x", "echo": True}, "echo", fim),
                                ({"suffix": "x", "prompt": [[1, 2]]}, "suffix", fim),
                                ({"suffix": "x"}, "suffix", None)]:
        with pytest.raises(APIError) as e:
            parse("completion", {"model": "m", "prompt": "a", **body}, model_name="m",
                  encode=enc, infill=infill)
        assert e.value.status == 400 and e.value.param == field, body
    assert job.params.top_k == 3 and job.params.seed == 7
    for body, field in [({"model": "m", "messages": [], "tools": [{"type": "function"}]}, "tools"),
                        ({"model": "m", "messages": [], "frobnicate": 1}, "frobnicate"),
                        ({"model": "m", "messages": [], "stop": 3}, "stop")]:
        with pytest.raises(APIError) as e:
            parse("chat", body, model_name="m", encode=enc)
        assert e.value.status == 400 and e.value.param == field
    # Content parts (what current clients send) are text joined; an assistant's null content
    # (a tool call's turn) is empty; other parts are named in a 400.
    seen = []
    parse("chat", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                     {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": None}]}, model_name="m",
        encode=lambda p, chat: seen.append(p) or [1])
    assert seen == [[{"role": "user", "content": "Hello, world"},
                     {"role": "assistant", "content": ""}]]
    with pytest.raises(APIError, match="image_url") as e:
        parse("chat", {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, model_name="m", encode=enc)
    assert e.value.param == "messages"
    for bad, field in [({"top_p": 0}, "top_p"), ({"top_k": 2**40}, "top_k"), ({"n": 0}, "n"),
                       ({"n": 1.5}, "n"), ({"min_p": 1.5}, "min_p"), ({"min_p": "x"}, "min_p")]:
        with pytest.raises(APIError) as e:
            parse("completion", {"model": "m", "prompt": "x", **bad}, model_name="m",
                  encode=enc)
        assert e.value.param == field


def test_stop_answers_requests_before_the_round_in_flight_ends():
    """A stop (SIGTERM's handler) gives every open request its error at once, not when the
    round in flight ends: uvicorn cuts the connections it still waits on after its graceful
    timeout, and a round can take seconds. Each request gets one last event."""
    from ssd_jax.config import SamplingParams
    from ssd_jax.serve.protocol import Job
    from ssd_jax.serve.scheduler import Request, Scheduler
    in_round, release = threading.Event(), threading.Event()

    class SlowBatch:  # one slot; its round blocks until released
        def free_slots(self):
            return [0]

        def join(self, slot, ids, params, stops, logprobs=None, prompt_logprobs=False):
            return 7, None

        def step(self, logprobs=None):
            in_round.set()
            release.wait(30)
            return np.array([[7, -1]]), np.array([False]), None, None

        def leave(self, slot):
            pass

    sched = Scheduler(SlowBatch(), lambda ids: "x" * len(ids), "ar", 0, max_queue=4)
    sched.start()
    got = {name: [] for name in ("running", "queued")}
    for name in got:
        job = Job("completion", "m", [1, 2], SamplingParams(max_new_tokens=100), False, False)
        sched.submit(Request(job, got[name].append, set()))
    assert in_round.wait(30)
    sched.stop(timeout=0)
    for events in got.values():
        assert [e[0] for e in events if e[0] != "delta"] == ["error"], events
    release.set()
    sched._thread.join(30)
    assert not sched.alive()
    for events in got.values():  # the decode thread's own end adds nothing
        assert [e[0] for e in events if e[0] != "delta"] == ["error"], events


def test_ctrl_c_while_the_server_loads_is_one_line():
    """Ctrl-C before the server listens (loading, compiling, warming up) ends it with one
    line and status 130, not a traceback."""
    import signal
    import subprocess
    import sys
    # A parallel test run's workers ignore SIGINT, and a child inherits that (Python then
    # installs no handler of its own): the server gets Python's own, as from a shell.
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)"
             "; sys.argv[0] = 'ssd-serve'; runpy.run_module('ssd_jax.serve', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", start, "--model", MODEL, "--mode", "ar",
                             "--slots", "1", "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        seen = []  # up to the warm-up's first line: the round compiles for seconds after it
        for line in proc.stderr:
            seen.append(line)
            if "warming up" in line:
                break
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + err
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "ssd-serve: interrupted"


def test_ctrl_c_inside_a_gc_callback_still_ends_the_server():
    """Python swallows a KeyboardInterrupt raised inside a garbage-collection callback (jax
    registers one), which once left the server loading after a Ctrl-C (a CI run): the handler
    must end the process itself. The callback here sends the signal to its own process."""
    import subprocess
    import sys
    start = ("import gc, os, signal, time; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
             "from ssd_jax.serve.__main__ import _exit_on_ctrl_c\n"
             "_exit_on_ctrl_c()\n"
             "def hit(phase, info):\n"
             "    if phase == 'start':\n"
             "        os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
             "gc.callbacks.append(hit); gc.collect(); gc.callbacks.remove(hit)\n"
             "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["ssd-serve: interrupted"], proc.stderr


def test_server_process_start_up_and_shutdown(served):
    """`ssd-serve` as a user starts it: a taken port or a bad one is one line before any
    model loads; SSD on this CPU decodes in two worker processes (driver auto), and a greedy
    answer equals offline AR's; SIGTERM with a request decoding ends that request with an
    error event and the process, workers included, within seconds, not after the request's
    2000 tokens."""
    import httpx
    import signal
    import subprocess
    import sys
    taken = _bound_socket()
    port = taken.getsockname()[1]
    base = [sys.executable, "-m", "ssd_jax.serve", "--model", MODEL, "--draft",
            "smollm2-draft", "--mode", "ssd", "--k", "2", "--budget", "4", "--slots", "2",
            "--max-logprobs", "-1"]  # (one warm-up request: fewer programs to compile)
    for extra, needle in ((["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                          (["--port", "70000"], "--port 70000 is invalid"),
                          (["--api-key", " "], "--api-key is empty")):
        t0 = time.time()
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and needle in lines[-1] and "Traceback" not in r.stderr, r.stderr
        assert time.time() - t0 < 60  # before the model loads and compiles
    taken.close()
    # The API key from the environment, as a deployment passes it.
    proc = subprocess.Popen(base + ["--port", str(port)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SSD_JAX_API_KEY": "sk-test"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        # /v1 needs the key; /health (above) and /metrics do not.
        import openai
        r = httpx.get(url + "/v1/models")
        assert r.status_code == 401 and "sent no API key" in r.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
        assert [m.id for m in keyed.models.list().data] == [MODEL]
        assert httpx.get(url + "/metrics").status_code == 200
        workers = _children(proc.pid)
        assert len(workers) == 2 and all("ssd_jax.runtime.worker" in c for c in workers.values())
        prompt = PROMPTS[3]
        text, n, _ = served[2][False, prompt]  # offline AR's answer, alone
        got = keyed.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        assert got.choices[0].text == text
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sk-test"}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            t0 = time.time()
            rest = list(lines)
        assert any('"server_error"' in line for line in rest), rest[-3:]
        # uvicorn re-raises the signal once it has shut down: the status says SIGTERM ended it
        assert proc.wait(30) in (0, -signal.SIGTERM) and time.time() - t0 < 20
        deadline = time.time() + 10  # the workers die with it (PR_SET_PDEATHSIG)
        while not all(map(_gone, workers)) and time.time() < deadline:
            time.sleep(0.2)
        assert all(map(_gone, workers))
    finally:
        if proc.poll() is None:
            proc.kill()


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie (exited; its new parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _children(pid: int) -> dict[int, str]:
    """The child processes of `pid` and their command lines (Linux /proc)."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    out[int(child)] = c.read().replace(b"\0", b" ").decode()
    return out


@pytest.mark.slow  # ~2-3 min: two servers, each a two-process pod that loads and compiles
def test_bench_load_on_pinned_pods(tmp_path):
    """`ssd-bench serve --pin`: each mode's server is a two-process pod on this machine, the
    target on one core and the draft on the other (the CPU server's SSD overlaps only so);
    every streamed answer equals its prompt's non-streamed one, and the SSD server's answers
    carry its cache hits."""
    from bench.serve_load import main
    out = tmp_path / "load.json"
    assert main(["--pair", "smollm2", "--modes", "ar,ssd", "--pin", "--clients", "2",
                 "--requests", "4", "--max-tokens", "12", "--num-prompts", "2", "--slots", "2",
                 "--k", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"ar", "ssd"}
    for mode, r in rows.items():
        assert r["requests"] == 4 and r["mismatched"] == 0 and r["tok_s"] > 0
    assert rows["ssd"]["k"] == 2 and 0 <= rows["ssd"]["hit_rate"] <= 1
