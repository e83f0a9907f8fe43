"""python -m ssd_jax.serve --model M --draft D --mode ar|sd|ssd --host 127.0.0.1 --port N

On a CPU, SSD's target and draft run in two pinned worker processes (`--driver auto`, as
offline; runtime/pool_live.py), the only way they overlap there. On a pod (every host runs the
same command; `--mesh NT,ND` spans processes) the target group's first process serves HTTP and
the others run their part of each round (runtime/pod_live.py)."""
from __future__ import annotations

import argparse
import logging
import os
import sys


API_KEY_ENV = "SSD_JAX_API_KEY"


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
    a("--max-logprobs", type=int, default=20,
      help="the most top_logprobs a request may ask for (-1: refuse logprobs)")
    a("--max-seq-len", type=int, default=2048, help="prompt + max_tokens + K + 1, at most")
    a("--k", type=int, default=None, help="lookahead (default: chosen by the speed model)")
    a("--budget", type=int, default=0, help="SSD branches per row (0: chosen or 2(K+1))")
    a("--dtype", default="float32", choices=["float32", "bfloat16"])
    a("--draft-vocab", type=int, default=None, metavar="N",
      help="cut the draft's LM head to its N most frequent tokens (cheaper draft steps)")
    a("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
      help="use XLA's matrix products on a CPU, not ssd-jax's kernel for a few rows (slower: for A/B runs)")
    a("--draft-precision", default="fp32", choices=["fp32", "bf16"],
      help="the draft's form on the CPU kernel: bf16 weights and inputs, fp32 sums (~1.7x cheaper draft steps; lossless)")
    a("--driver", default="auto", choices=["auto", "single", "processes"],
      help="where rounds run: auto = two pinned worker processes for SSD on a CPU, else "
           "this process")
    a("--mesh", default=None, metavar="NT,ND",
      help="target devices, draft devices (a pod: meshes across the job's processes)")
    a("--api-key", default=os.environ.get(API_KEY_ENV) or None,
      help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}, else none; "
           "the variable keeps the key out of the process list)")
    return ap


def main(argv=None) -> int:
    _exit_on_ctrl_c()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # from a SIGINT handler of the caller's own, left in place
        _interrupted()


def _interrupted(*_) -> None:
    """Ctrl-C before the server listens (loading, compiling, warming up): one line, status 130.
    Not through the interpreter's shutdown: with XLA's threads cut off mid-compile it can crash
    (SIGSEGV) after this line."""
    print("ssd-serve: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def _exit_on_ctrl_c() -> None:
    """Exit from the SIGINT handler itself rather than through a KeyboardInterrupt: Python
    swallows an exception raised inside a garbage-collection callback (jax registers one), so
    a Ctrl-C landing there was lost and the server went on loading. uvicorn installs its own
    handler while it serves. A SIGINT the caller ignores (nohup, a test runner) stays ignored."""
    import signal
    import threading
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _interrupted)


def _main(argv) -> int:
    args = parser().parse_args(argv)
    from ssd_jax.__main__ import parse_mesh, quiet_logging
    from ssd_jax.xla_cpu import prefer_wide_vectors
    prefer_wide_vectors()
    quiet_logging()
    for flag, v in (("--slots", args.slots), ("--max-queue", args.max_queue)):
        if v < 1:
            print(f"ssd-serve: error: {flag} {v} is invalid: it must be >= 1", file=sys.stderr)
            return 2
    if args.max_logprobs < -1:
        print(f"ssd-serve: error: --max-logprobs {args.max_logprobs} is invalid: give -1 (no "
              "logprobs) or a count >= 0", file=sys.stderr)
        return 2
    if args.api_key is not None and not args.api_key.strip():
        print("ssd-serve: error: --api-key is empty: give a key, or leave the option out for "
              "an open server", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"ssd-serve: error: --port {args.port} is invalid: give 1-65535 (0: any free "
              "port)", file=sys.stderr)
        return 2
    import uvicorn
    from ssd_jax import LLM, EngineConfig
    from ssd_jax.config import SpecConfig
    from ssd_jax.runtime import distributed
    from ssd_jax.serve.app import build_app
    from ssd_jax.serve.server import Server
    draft = None if args.draft in ("none", "") or args.mode == "ar" else args.draft
    sock = None
    try:
        distributed.initialize()  # a pod: join the job before anything touches a device
        import jax
        if jax.process_index() == 0:  # the lead, unless the pod's split says otherwise
            # Bound before the models load: a taken port is an error now, not minutes later
            # after a "listening" line.
            sock = _bind(args.host, args.port)
        mesh = parse_mesh(args.mesh)
        spec = SpecConfig(k=args.k, budget=args.budget)
        llm = LLM(args.model, draft=draft, dtype=args.dtype, spec=spec, engine=EngineConfig(
            max_batch=args.slots, max_seq_len=args.max_seq_len, driver=args.driver, mesh=mesh,
            draft_vocab=args.draft_vocab, cpu_kernels=args.cpu_kernels,
            draft_precision=args.draft_precision))
        if not llm.is_lead:  # a pod process other than the lead: it runs its part of rounds
            if sock is not None:
                sock.close()
            llm.follow()
            return 0
        server = Server(llm, mode=args.mode, model_name=args.served_model_name or args.model,
                        slots=args.slots, max_queue=args.max_queue,
                        max_logprobs=args.max_logprobs)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"ssd-serve: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        sock = sock or _bind(args.host, args.port)
    except OSError as e:
        print(f"ssd-serve: error: {e}", file=sys.stderr)
        server.shutdown()
        return 2
    host, port = sock.getsockname()[:2]
    logging.getLogger("ssd_jax").info("listening on http://%s:%d/v1", host, port)
    # Requests still running when the server is told to stop get an error at once, so their
    # connections close and the process exits in seconds; the graceful timeout bounds the
    # rest (a client that never reads).
    config = uvicorn.Config(build_app(server, api_key=args.api_key), log_level="warning",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server_stops = server.scheduler.stop

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            server_stops(timeout=0)  # before uvicorn waits for the open connections
            super().handle_exit(sig, frame)
    Uvicorn(config).run(sockets=[sock])  # the app's lifespan closes the engine
    return 0


SHUTDOWN_GRACE_S = 5


def _bind(host: str, port: int):
    """A socket bound to host:port for uvicorn; OSError naming the address and the fix."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}: stop what holds it or "
                      "pass another --port / --host") from None
    return sock


if __name__ == "__main__":
    sys.exit(main())
