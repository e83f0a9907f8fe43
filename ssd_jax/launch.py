"""Start a multi-process `jax.distributed` job on this machine, as a pod would run on several
hosts (like `torchrun` for development and tests):

    python -m ssd_jax.launch --processes 3 --devices-per-process 1 -- \\
        python -m ssd_jax --model M --draft D --mode ssd --mesh 2,1 "a prompt"

Each process gets SSD_JAX_COORDINATOR / SSD_JAX_NUM_PROCESSES / SSD_JAX_PROCESS_ID (what
`runtime.distributed.initialize` reads on a real pod) and, on CPU, its own fake devices. With
--pin each process also gets its own share of this machine's cores: XLA:CPU spreads every
computation over all the cores a process may use, so unpinned processes fight over them, and a
draft on its own core is what lets SSD overlap drafting with verification on a CPU:

    python -m ssd_jax.launch --processes 2 --devices-per-process 1 --pin -- \\
        python -m ssd_jax.serve --model M --draft D --mode ssd --mesh 1,1

The processes' output is prefixed with `[i]`. When a process fails, the launcher says which,
waits up to --grace seconds for the others to end by themselves (a pod's processes notice a
dead peer on their own, runtime/pod.py), then kills what is left; none outlive the launcher.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from ssd_jax.runtime.procs import die_with_parent, free_port
from ssd_jax.xla_cpu import with_device_count


def _pump(i: int, stream, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"[{i}] {line.decode('utf-8', 'replace')}")
        out.flush()


def _status(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def core_shares(usable: list[int], processes: int) -> list[list[int]]:
    """`usable` cores split into `processes` contiguous shares of equal size (the cores left
    over go unused: unequal shares would make one process's step slower than its peers')."""
    if processes > len(usable):
        raise ValueError(f"--pin: {processes} processes but {len(usable)} usable cores: give "
                         f"--processes {len(usable)} or fewer, or leave out --pin")
    n = len(usable) // processes
    return [usable[i * n:(i + 1) * n] for i in range(processes)]


def _start_on(cores: list[int] | None):
    """A child's set-up before exec: die with the launcher; run on `cores` if given."""
    def setup() -> None:
        die_with_parent()
        if cores is not None:
            os.sched_setaffinity(0, cores)
    return setup


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ssd_jax.launch",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, required=True, help="processes in the job")
    ap.add_argument("--devices-per-process", type=int, default=None,
                    help="CPU devices per process (XLA's fake host devices); default: JAX's")
    ap.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    ap.add_argument("--pin", action="store_true",
                    help="give each process its own cores (this machine's, split evenly in "
                         "order; process 0 first)")
    ap.add_argument("--grace", type=float, default=60.0,
                    help="after a failure, seconds the others get to exit by themselves")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        print("ssd_jax.launch: error: no command: add `-- python -m ...`", file=sys.stderr)
        return 2
    if args.processes < 1:
        print(f"ssd_jax.launch: error: --processes {args.processes}: give 1 or more",
              file=sys.stderr)
        return 2
    shares = [None] * args.processes
    if args.pin:
        if not hasattr(os, "sched_setaffinity"):
            print("ssd_jax.launch: error: --pin needs Linux (os.sched_setaffinity): leave out "
                  "--pin", file=sys.stderr)
            return 2
        try:
            shares = core_shares(sorted(os.sched_getaffinity(0)), args.processes)
        except ValueError as e:
            print(f"ssd_jax.launch: error: {e}", file=sys.stderr)
            return 2
        print("ssd_jax.launch: cores " + ", ".join(
            f"process {i}: {','.join(map(str, c))}" for i, c in enumerate(shares)),
            file=sys.stderr, flush=True)
    port = args.port or free_port()
    procs, pumps = [], []
    for i in range(args.processes):
        env = dict(os.environ, SSD_JAX_COORDINATOR=f"127.0.0.1:{port}",
                   SSD_JAX_NUM_PROCESSES=str(args.processes), SSD_JAX_PROCESS_ID=str(i),
                   PYTHONUNBUFFERED="1")
        if args.devices_per_process:
            env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""),
                                                 args.devices_per_process)
            env.setdefault("JAX_PLATFORMS", "cpu")
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, preexec_fn=_start_on(shares[i]))
        procs.append(p)
        t = threading.Thread(target=_pump, args=(i, p.stdout, sys.stdout), daemon=True)
        t.start()
        pumps.append(t)

    stopping = []

    def stop(signum, _frame):
        # Forwarded; JAX's preemption notice catches SIGTERM in a distributed process, so
        # whatever still runs 10 s later is killed.
        stopping.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    failed = None
    while [p.poll() for p in procs].count(None):  # poll every one: sets returncode
        if stopping and time.monotonic() - stopping[0] > 10:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        elif failed is None:
            for i, p in enumerate(procs):
                if p.returncode not in (None, 0):
                    failed = (i, time.monotonic())
                    print(f"ssd_jax.launch: process {i} {_status(p.returncode)}; waiting up to "
                          f"{args.grace:.0f} s for the others to stop", file=sys.stderr,
                          flush=True)
                    break
        elif time.monotonic() - failed[1] > args.grace:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    print(f"ssd_jax.launch: process {i} did not stop within {args.grace:.0f} s "
                          "of the failure: killed", file=sys.stderr, flush=True)
                    p.kill()
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    for t in pumps:
        t.join(timeout=5)
    codes = [p.returncode for p in procs]
    if failed is not None:
        print("ssd_jax.launch: " + ", ".join(f"process {i} {_status(c)}"
                                             for i, c in enumerate(codes)), file=sys.stderr)
        return codes[failed[0]] if codes[failed[0]] > 0 else 1
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
