"""One process of a pod test job (tests/test_pod.py runs it under `python -m ssd_jax.launch`).

Every process runs this file; the lead (target group's first process) makes the runs and
writes what they gave to OUT as JSON, the others follow. The decode loops run under
jax.transfer_guard_device_to_device("disallow") in every process, and the lead counts backend
compiles during a second batch of the same shapes.

    python tests/pod_job.py TARGET DRAFT OUT --mesh 2,1 [--sampled] [--slow-rounds]
"""
from __future__ import annotations

import argparse
import json
import sys

from ssd_jax.runtime import distributed

PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8]
SECOND = [[6, 2, 4], list(range(40, 58)), [9] * 5]  # the shapes of PROMPTS (bucket 32)
SAMPLED_SEEDS = (11, 12, 13)  # one per prompt, T = 1, 16 tokens


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("out")
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--sampled", action="store_true")
    ap.add_argument("--long", action="store_true",
                    help="keep generating (for the kill tests): SSD runs until killed")
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
    llm = LLM(args.target, draft=args.draft, spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16, mesh=mesh),
              progress=False)
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
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
