"""`ssd-bench serve`: load on the OpenAI server, per mode.

For each mode it starts `python -m ssd_jax.serve` on a free loopback port (or uses --url),
sends every distinct prompt once without streaming (warm-up, and the reference text), then runs
--clients concurrent streaming clients over --requests requests (bounded by --duration) and
reports throughput, TTFT and TPOT percentiles, and lost or duplicated text: every streamed
answer must equal its prompt's reference (greedy requests are deterministic).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.cli import PAIRS
from bench.suites import SUITES, load_suite
from ssd_jax.runtime.procs import free_port


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ssd-bench serve", description=__doc__.splitlines()[0])
    a = ap.add_argument
    a("--pair", default="smollm2", choices=sorted(PAIRS))
    a("--modes", default="ar,sd,ssd", help="comma list of ar, sd, ssd")
    a("--url", default=None, help="an already running server (then one mode: its own)")
    a("--clients", type=int, default=64, help="concurrent streaming clients")
    a("--requests", type=int, default=128, help="requests in all (each client takes the next)")
    a("--duration", type=float, default=600.0, help="stop sending after this many seconds")
    a("--max-tokens", type=int, default=64)
    a("--suite", default="chat", choices=SUITES)
    a("--num-prompts", type=int, default=16, help="distinct prompts cycled over")
    a("--slots", type=int, default=8, help="rows the started server decodes at once")
    a("--max-queue", type=int, default=256)
    a("--k", type=int, default=None, help="lookahead for the started servers (default: chosen)")
    a("--draft-vocab", type=int, default=None, metavar="N",
      help="the started servers' draft LM head cut to N columns (ssd-serve --draft-vocab)")
    a("--pin", action="store_true",
      help="start each server as a two-process pod on this machine, the target on one half of "
           "the cores and the draft on the other (python -m ssd_jax.launch --pin, --mesh 1,1): "
           "on a CPU the only way its SSD overlaps drafting with verification; AR and SD then "
           "run on the target's half alone")
    a("--json", default=None, metavar="PATH")
    return ap


def start_server(args, mode: str) -> tuple[subprocess.Popen, str]:
    target, draft = PAIRS[args.pair]
    port = free_port()
    cmd = [sys.executable, "-m", "ssd_jax.serve", "--model", target, "--draft", draft,
           "--mode", mode, "--port", str(port), "--slots", str(args.slots),
           "--max-queue", str(args.max_queue)] + (["--k", str(args.k)] if args.k else [])
    if args.draft_vocab:
        cmd += ["--draft-vocab", str(args.draft_vocab)]
    if args.pin:
        cmd = [sys.executable, "-m", "ssd_jax.launch", "--processes", "2",
               "--devices-per-process", "1", "--pin", "--"] + cmd + ["--mesh", "1,1"]
    # Its output to a file, read on failure: a pod's processes print through the launcher's
    # stdout, and a pipe nobody drains would block a chatty server.
    out = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    import httpx
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 900
    while True:
        if proc.poll() is not None:
            out.seek(0)
            raise SystemExit(f"ssd-bench serve: the {mode} server exited: "
                             f"{out.read().decode('utf-8', 'replace')[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"ssd-bench serve: the {mode} server did not start in 900 s")
        time.sleep(1)


async def one(http, url: str, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = dict(model=model, messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, temperature=0, stream=stream,
                **({"stream_options": {"include_usage": True}} if stream else {}))
    t0 = time.perf_counter()
    if not stream:
        r = await http.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        d = r.json()
        return dict(text=d["choices"][0]["message"]["content"],
                    tokens=d["usage"]["completion_tokens"], spec=d.get("speculation"))
    text, first, tokens, spec = [], None, 0, None
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            spec = d.get("speculation") or spec
            for c in d.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return dict(text="".join(text), tokens=tokens, ttft=(first or end) - t0,
                tpot=(end - first) / max(tokens - 1, 1) if first else None, spec=spec)


async def load(args, url: str, model: str, prompts: list[str]) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        ref = {}
        for p in prompts:  # warm-up and references, one at a time
            ref[p] = (await one(http, url, model, p, args.max_tokens, False))["text"]
        queue = [prompts[i % len(prompts)] for i in range(args.requests)]
        results, stop_at = [], time.perf_counter() + args.duration
        t0 = time.perf_counter()

        async def client():
            while queue and time.perf_counter() < stop_at:
                p = queue.pop()
                r = await one(http, url, model, p, args.max_tokens, True)
                results.append(dict(r, ok=r["text"] == ref[p]))

        await asyncio.gather(*[client() for _ in range(args.clients)])
        wall = time.perf_counter() - t0
    ttft = np.array([r["ttft"] for r in results])
    tpot = np.array([r["tpot"] for r in results if r["tpot"] is not None])
    return dict(requests=len(results), wall_s=wall,
                tok_s=sum(r["tokens"] for r in results) / wall,
                ttft_p50_ms=1e3 * np.percentile(ttft, 50), ttft_p99_ms=1e3 * np.percentile(ttft, 99),
                tpot_p50_ms=1e3 * np.percentile(tpot, 50), tpot_p99_ms=1e3 * np.percentile(tpot, 99),
                mismatched=sum(not r["ok"] for r in results),
                hit_rate=np.mean([r["spec"]["cache_hit_rate"] for r in results
                                  if r["spec"] and "cache_hit_rate" in r["spec"]] or [np.nan]))


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if min(args.clients, args.requests, args.max_tokens, args.num_prompts) < 1:
        print("ssd-bench serve: error: --clients, --requests, --max-tokens and --num-prompts "
              "must be >= 1", file=sys.stderr)
        return 2
    prompts = [p.text for p in load_suite(args.suite, args.num_prompts)]
    modes = ["served"] if args.url else [m.strip() for m in args.modes.split(",")]
    rows = {}
    for mode in modes:
        proc = None
        url = args.url
        if url is None:
            proc, url = start_server(args, mode)
        try:
            import httpx
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            health = httpx.get(url + "/health").json()
            rows[mode] = dict(asyncio.run(load(args, url, model, prompts)),
                              k=health.get("k"), budget=health.get("budget"))
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        print(f"{mode}: {json.dumps(rows[mode], default=float)}", file=sys.stderr)
    print("| mode | requests | clients | tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
          "hit rate | lost or duplicated |\n|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        hit = "–" if np.isnan(r["hit_rate"]) else f"{r['hit_rate']:.2f}"
        print(f"| {mode} | {r['requests']} | {args.clients} | {r['tok_s']:.1f} | "
              f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.0f} / "
              f"{r['tpot_p99_ms']:.0f} | {hit} | {r['mismatched']} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(command="ssd-bench serve " + " ".join(argv or sys.argv[1:]),
                           rows=rows), f, indent=1)
    return 0
