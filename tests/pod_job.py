"""One process of a pod test job (tests/test_pod.py runs it under `python -m ssd_jax.launch`).

Every process runs this file; the lead (target group's first process) makes the runs and
writes what they gave to OUT as JSON, the others follow. The decode loops run under
jax.transfer_guard_device_to_device("disallow") in every process, and the lead counts backend
compiles during a second batch of the same shapes.

    python tests/pod_job.py TARGET DRAFT OUT --mesh 2,1 [--sampled] [--serve] [--long]

--serve: last, the lead serves the OpenAI API from the pod (ssd_jax.serve's Server) and the
official client sends a seeded sampled request alone, then greedy requests at once, then one
asking for log-probabilities.
"""
from __future__ import annotations

import argparse
import json
import sys

from ssd_jax.runtime import distributed

PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8]
SECOND = [[6, 2, 4], list(range(40, 58)), [9] * 5]  # the shapes of PROMPTS (bucket 32)
SAMPLED_SEEDS = (11, 12, 13)  # one per prompt, T = 1, 16 tokens
# The server's requests (the target has a word-level tokenizer, "w<id>"): 4 greedy requests of
# different lengths for 2 slots, so rows join and leave a running batch.
SERVE_SLOTS = 2
SERVE_GREEDY = [("w5 w9 w11", 9), ("w20 w21 w22 w23 w24 w25", 14), ("w7 w7 w7", 5),
                ("w3 w1 w4 w1 w5", 11)]
SERVE_SAMPLED = ("w40 w41 w42", 12, 7)  # prompt, max_tokens, seed; T = 1
SERVE_BIAS = {5: 3.0, 9: -100.0, 21: 1.5}  # logit_bias of a greedy request (SERVE_GREEDY[1])
# An offline SSD batch on the pod in which two rows ask for log-probabilities (one sampled)
# and one for its prompt's.
LOGPROBS = [dict(max_new_tokens=12, logprobs=2),
            dict(max_new_tokens=9, temperature=1.0, seed=3, logprobs=0),
            dict(max_new_tokens=10, prompt_logprobs=2)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("out")
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--sampled", action="store_true")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--auto", action="store_true",
                    help="an SSD run with automatic settings (step costs measured on the pod)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--long", action="store_true",
                    help="keep generating (for the kill tests): SSD runs until killed")
    ap.add_argument("--slow-target-load", type=float, default=0.0, metavar="S",
                    help="the target group's processes take S seconds longer to load the "
                         "target (as a big target beside a small draft does); greedy SSD only")
    args = ap.parse_args()
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack, to debug a hang
    distributed.initialize()
    import os
    import jax
    print(f"pid {os.getpid()} is process {jax.process_index()}", flush=True)
    from jax import monitoring
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    jax.config.update("jax_transfer_guard_device_to_device", "disallow")
    mesh = tuple(int(x) for x in args.mesh.split(","))
    if args.slow_target_load:
        import time
        from ssd_jax import engine
        real_load = engine.load

        def slow_load(path, **kw):
            if path == args.target:
                time.sleep(args.slow_target_load)
            return real_load(path, **kw)
        engine.load = slow_load
    llm = LLM(args.target, draft=args.draft, spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16, mesh=mesh),
              cache_dir=args.cache_dir, progress=False)
    # Every compiled program to the compilation cache (test_pod checks who writes), however
    # fast this machine compiles the tiny models.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if not llm.is_lead:
        llm.follow()
        return 0
    out: dict = {"pod": llm.core.pod.describe()}
    with llm:
        greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
        if args.long:
            p = SamplingParams(max_new_tokens=200, ignore_eos=True)
            while True:
                llm.generate(PROMPTS, p, mode="ssd", chat=False)
                print("round of requests done", flush=True)
        if args.slow_target_load:  # the draft group is in its first round long before
            out["ssd"] = [o.token_ids for o in llm.generate(PROMPTS, greedy, mode="ssd",
                                                            chat=False)]
            with open(args.out, "w") as f:
                json.dump(out, f)
            return 0
        for mode in ("ssd", "sd", "ar"):
            out[mode] = [o.token_ids for o in llm.generate(PROMPTS, greedy, mode=mode,
                                                           chat=False)]
        m = llm.last_metrics
        out["ar_metrics"] = dict(new_tokens=m.new_tokens)
        compiles = []

        def listen(name, secs, **kw):
            if name == "/jax/core/compile/backend_compile_duration":
                compiles.append(name)
        monitoring.register_event_duration_secs_listener(listen)
        jax.config.update("jax_log_compiles", True)  # names them in the log if any
        res = llm.generate(SECOND, greedy, mode="ssd", chat=False)
        out["second"] = [o.token_ids for o in res]
        out["second_compiles"] = len(compiles)
        out["ssd_hit_rate"] = res[0].metrics.ssd.hit_rate
        monitoring.unregister_event_duration_listener(listen)
        jax.config.update("jax_log_compiles", False)
        if args.sampled:
            ps = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=s, ignore_eos=True)
                  for s in SAMPLED_SEEDS]
            out["sampled_ssd"] = [o.token_ids for o in llm.generate(PROMPTS, ps, mode="ssd",
                                                                    chat=False)]
            # Log-probabilities from the pod's target (across processes where it is TP).
            res = llm.generate(PROMPTS, [SamplingParams(ignore_eos=True, **kw)
                                         for kw in LOGPROBS], mode="ssd", chat=False)
            out["logprobs"] = [[o.token_ids, o.logprobs and [sorted(d.items())
                                                             for d in o.logprobs]] for o in res]
            out["prompt_logprobs"] = [o.prompt_logprobs and [d and sorted(d.items())
                                                             for d in o.prompt_logprobs]
                                      for o in res]
        # More rows than max_batch: one continuous batch, the lead's live batch mirrored by
        # the other processes, closed after (the server below opens another).
        res = llm.generate(PROMPTS + SECOND, greedy, mode="ssd", chat=False)
        out["continuous"] = [o.token_ids for o in res]
        if args.auto:
            res = llm.generate(PROMPTS, greedy, mode="ssd", chat=False, spec=SpecConfig())
            out["auto"] = [o.token_ids for o in res]
            out["auto_settings"] = res[0].metrics.settings
        if args.serve:  # last: the server's shutdown ends the followers
            out["served"] = serve(llm)
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


def serve(llm) -> dict:
    """The OpenAI server on the pod's lead, queried by the official client."""
    import socket
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor
    import openai
    import uvicorn
    from ssd_jax.serve.app import build_app
    from ssd_jax.serve.server import Server
    server = Server(llm, mode="ssd", model_name="tiny", slots=SERVE_SLOTS, max_queue=8)
    # The socket is bound here and handed to uvicorn: a port found free and bound later can be
    # taken in between (this job's processes open many connections), and a server that never
    # starts must be an error, not a wait.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the OpenAI server on the lead did not start")
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=600)

    def complete(prompt, n, **kw):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                         extra_body={"ignore_eos": True}, **kw).choices[0].text

    prompt, n, seed = SERVE_SAMPLED
    got = {"sampled": complete(prompt, n, temperature=1.0, seed=seed)}
    with ThreadPoolExecutor(len(SERVE_GREEDY)) as pool:
        got["greedy"] = list(pool.map(lambda pn: complete(*pn, temperature=0.0), SERVE_GREEDY))
    got["biased"] = complete(*SERVE_GREEDY[1], temperature=0.0,
                             logit_bias={str(t): v for t, v in SERVE_BIAS.items()})
    r = client.completions.create(model="tiny", prompt=SERVE_GREEDY[0][0],
                                  max_tokens=SERVE_GREEDY[0][1], temperature=0.0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    got["logprobs"] = dict(text=r.choices[0].text, chosen=lp.token_logprobs,
                           top=[sorted(t.values(), reverse=True) for t in lp.top_logprobs])
    # echo: the prompt's log-probabilities from the joining row's prefill, run SPMD by the
    # target group (the mirrored join carries the switch).
    r = client.completions.create(model="tiny", prompt=SERVE_GREEDY[0][0], max_tokens=1,
                                  temperature=0.0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    got["echo"] = dict(chosen=lp.token_logprobs, top=[
        None if t is None else sorted(t.values(), reverse=True) for t in lp.top_logprobs])
    uv.should_exit = True
    thread.join(60)
    got["stopped"] = not server.scheduler._thread.is_alive()
    return got


if __name__ == "__main__":
    sys.exit(main())
