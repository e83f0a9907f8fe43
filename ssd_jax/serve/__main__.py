"""python -m ssd_jax.serve --model M --draft D --mode ar|sd|ssd --host 127.0.0.1 --port N

On a pod (every host runs the same command; `--mesh NT,ND` spans processes) the target group's
first process serves HTTP and the others run their part of each round (runtime/pod_live.py)."""
from __future__ import annotations

import argparse
import logging
import sys


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ssd-serve", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = ap.add_argument
    a("--model", default="qwen2.5-coder-1.5b", help="target: a name, .gguf, HF or orbax dir")
    a("--draft", default="qwen2.5-coder-0.5b", help="draft (same kinds); none for AR only")
    a("--mode", default="ssd", choices=["ar", "sd", "ssd"])
    a("--served-model-name", default=None, help="the model name clients send (default: --model)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--slots", type=int, default=4, help="requests decoding at once (the batch's rows)")
    a("--max-queue", type=int, default=64, help="requests that may wait for a slot (more: 429)")
    a("--max-seq-len", type=int, default=2048, help="prompt + max_tokens + K + 1, at most")
    a("--k", type=int, default=None, help="lookahead (default: chosen by the speed model)")
    a("--budget", type=int, default=0, help="SSD branches per row (0: chosen or 2(K+1))")
    a("--dtype", default="float32", choices=["float32", "bfloat16"])
    a("--draft-vocab", type=int, default=None, metavar="N",
      help="cut the draft's LM head to its N most frequent tokens (cheaper draft steps)")
    a("--mesh", default=None, metavar="NT,ND",
      help="target devices, draft devices (a pod: meshes across the job's processes)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from ssd_jax.__main__ import parse_mesh, quiet_logging
    from ssd_jax.xla_cpu import prefer_wide_vectors
    prefer_wide_vectors()
    quiet_logging()
    for flag, v in (("--slots", args.slots), ("--max-queue", args.max_queue),
                    ("--port", args.port + 1)):
        if v < 1:
            print(f"ssd-serve: error: {flag} {v} is invalid: it must be >= 1", file=sys.stderr)
            return 2
    import uvicorn
    from ssd_jax import LLM, EngineConfig
    from ssd_jax.config import SpecConfig
    from ssd_jax.runtime import distributed
    from ssd_jax.serve.app import build_app
    from ssd_jax.serve.server import Server
    draft = None if args.draft in ("none", "") or args.mode == "ar" else args.draft
    try:
        distributed.initialize()  # a pod: join the job before anything touches a device
        mesh = parse_mesh(args.mesh)
        spec = SpecConfig(k=args.k, budget=args.budget)
        llm = LLM(args.model, draft=draft, dtype=args.dtype, spec=spec, engine=EngineConfig(
            max_batch=args.slots, max_seq_len=args.max_seq_len, driver="single", mesh=mesh,
            draft_vocab=args.draft_vocab))
        if not llm.is_lead:  # a pod process other than the lead: it runs its part of rounds
            llm.follow()
            return 0
        server = Server(llm, mode=args.mode, model_name=args.served_model_name or args.model,
                        slots=args.slots, max_queue=args.max_queue)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"ssd-serve: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    logging.getLogger("ssd_jax").info("listening on http://%s:%d/v1", args.host, args.port)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
