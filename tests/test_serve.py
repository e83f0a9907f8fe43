"""The OpenAI-compatible server (ssd_jax.serve): the official `openai` client against a server
started in this process on the loopback address, SmolLM2 with its distilled draft in SSD mode.
Greedy text equals offline generate; staggered requests join a running batch; a disconnected
stream frees its row; bad requests are 400s, a full queue a 429."""
import json
import socket
import threading
import time

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
    # Offline references, each request alone (greedy AR: SSD's output is the same by design).
    want = {}
    for chat in (False, True):
        for i, p in enumerate(PROMPTS):
            n = 6 + 3 * i
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
            (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 400, "does not exist"),
            (json.dumps({"model": MODEL, "prompt": "x", "n": 2}).encode(), 400, "'n'=2"),
            (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400,
             "'temperature'=-1"),
            (json.dumps({"model": MODEL, "prompt": "x", "logprobs": 3}).encode(), 400,
             "'logprobs'"),
            (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**6}).encode(), 400,
             "context")]:
        r = httpx.post(url + "/v1/completions", content=payload, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == status and needle in r.json()["error"]["message"], r.text


def test_full_queue_is_429(served):
    import httpx
    server, url, _ = served
    server.scheduler.max_queue, body = 1, {"model": MODEL, "prompt": PROMPTS[2],
                                            "max_tokens": 300, "temperature": 0, "stream": True}
    streams = []
    try:
        with httpx.Client(timeout=60) as http:
            for _ in range(5):  # 4 slots, then one waiting
                streams.append(http.stream("POST", url + "/v1/completions", json=body))
                streams[-1].__enter__()
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
    job = parse("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "stop": ["\n\n", "END"], "max_completion_tokens": 5, "top_k": 3,
                         "seed": 7}, model_name="m", encode=enc)
    assert job.stop == ["\n\n", "END"] and job.params.max_new_tokens == 5
    assert job.params.top_k == 3 and job.params.seed == 7
    for body, field in [({"model": "m", "messages": [], "tools": [{"type": "function"}]}, "tools"),
                        ({"model": "m", "messages": [], "frobnicate": 1}, "frobnicate"),
                        ({"model": "m", "messages": [], "stop": 3}, "stop")]:
        with pytest.raises(APIError) as e:
            parse("chat", body, model_name="m", encode=enc)
        assert e.value.status == 400 and e.value.param == field


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
