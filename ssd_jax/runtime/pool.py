"""Start, feed and stop the two decode worker processes (target role, draft role).

One `WorkerPool` per LLM: started on first use, stopped by `close()`, at interpreter exit, on
errors and on Ctrl-C. Workers also die with this process (PR_SET_PDEATHSIG), so none is left
behind. On a machine with at least two cores the target is pinned to core 0 and the draft to
core 1: the target gets one core in every mode, SSD adds a second core for the draft, as the
paper adds a GPU for it.
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Listener

from ssd_jax import compile_cache
from ssd_jax.core.metrics import SSDStats, metrics_from_dict
from ssd_jax.runtime.procs import free_port
from ssd_jax.xla_cpu import with_device_count

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    pass


class WorkerPool:
    def __init__(self, target: str, draft: str, *, dtype: str = "float32",
                 cores: tuple[int, int] | None = None, start_timeout: float = 600.0,
                 devices_per_worker: int = 1, draft_vocab: int | None = None,
                 cpu_kernels: bool = True, draft_precision: str = "fp32"):
        self.target, self.draft, self.dtype = str(target), str(draft), dtype
        self.cpu_kernels, self.draft_precision = cpu_kernels, draft_precision
        self.draft_vocab = draft_vocab
        self.devices_per_worker = devices_per_worker
        # The cores this process may use (a container's cpuset need not start at core 0).
        usable = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                  else list(range(os.cpu_count() or 1)))
        self.cores = cores if cores is not None else (
            (usable[0], usable[1]) if len(usable) >= 2 else (None, None))
        self.start_timeout = start_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.conns: dict = {}
        self.layout: dict[str, dict] = {}  # role -> its devices and sharding, as reported
        self.logs: dict = {}  # role -> the file its stdout/stderr go to

    def start(self) -> None:
        if self.procs:
            return
        key = secrets.token_hex(16)
        listener = Listener(("127.0.0.1", 0), authkey=key.encode())
        address = "%s:%d" % listener.address
        coordinator = f"127.0.0.1:{free_port()}"
        env = dict(os.environ, SSD_JAX_WORKER_KEY=key, JAX_PLATFORMS="cpu")
        # One CPU device per worker process unless asked; the user's other XLA flags pass on.
        env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), self.devices_per_worker)
        # The workers compile into (and read from) the caller's compilation cache, or none.
        import jax
        env[compile_cache.ENV] = jax.config.jax_compilation_cache_dir or "off"
        log.info("starting the target and draft worker processes (cores %s); they load the "
                 "models (a minute or two for a 1.5B pair) ...", self.cores)
        atexit.register(self.close)
        try:
            for role, core in zip(("target", "draft"), self.cores):
                cmd = [sys.executable, "-m", "ssd_jax.runtime.worker", "--role", role,
                       "--address", address, "--coordinator", coordinator, "--target", self.target,
                       "--draft", self.draft, "--dtype", self.dtype]
                if core is not None:
                    cmd += ["--core", str(core)]
                if self.draft_vocab is not None:
                    cmd += ["--draft-vocab", str(self.draft_vocab)]
                if not self.cpu_kernels:
                    cmd += ["--no-cpu-kernels"]
                cmd += ["--draft-precision", self.draft_precision]
                # The workers' own output (gloo's connection lines, XLA warnings) goes to a log
                # file, not the user's terminal; its tail is quoted if a worker fails.
                self.logs[role] = tempfile.NamedTemporaryFile(
                    mode="w+b", prefix=f"ssd_jax-{role}-", suffix=".log", delete=False)
                self.procs[role] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                                    stdout=self.logs[role],
                                                    stderr=subprocess.STDOUT)
            # multiprocessing's Listener has no accept timeout; bound it on its socket so a
            # worker that dies before connecting cannot hang the caller.
            sock = getattr(getattr(listener, "_listener", None), "_socket", None)
            if sock is not None:
                sock.settimeout(self.start_timeout)
            pending = []
            for _ in range(2):
                pending.append(listener.accept())
            deadline = time.monotonic() + self.start_timeout
            for conn in pending:
                while not conn.poll(min(1.0, max(deadline - time.monotonic(), 0))):
                    self._check_alive()
                    if time.monotonic() > deadline:
                        raise WorkerError("worker processes did not become ready in "
                                          f"{self.start_timeout:.0f}s")
                kind, payload, *info = conn.recv()
                if kind != "ready":
                    raise WorkerError(f"worker failed to start:\n{payload}")
                self.conns[payload] = conn
                self.layout[payload] = info[0] if info else {}
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def step_costs(self, rows: int):
        """The target's scoring cost and the draft's step cost, measured in the two workers at
        once (each on its own core, slowing the other as it will in a run)."""
        from ssd_jax.autotune import DRAFT_TOKENS, TARGET_TOKENS, StepCosts
        self.start()
        try:
            self._send("target", ("costs", dict(rows=rows, tokens=TARGET_TOKENS)))
            self._send("draft", ("costs", dict(rows=rows, tokens=DRAFT_TOKENS)))
            target, draft = self._recv("target")[1], self._recv("draft")[1]
        except BaseException:
            self.close()
            raise
        return StepCosts({int(t): s for t, s in target.items()},
                         {int(t): s for t, s in draft.items()})

    def calibration_probs(self, prompt: list[int], n: int, temperature: float, top_k: int,
                          top_p: float, min_p: float = 0.0):
        """saguaro_curve's calibration: the target worker samples `n` tokens after `prompt`
        and gives its probabilities for them, then the draft worker its own for the same."""
        self.start()
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, last=n, min_p=min_p)
        try:
            self._send("target", ("probs", dict(tokens=prompt, **kw)))
            more, p = self._recv("target")[1]
            self._send("draft", ("probs", dict(tokens=prompt + more, **kw)))
            return p, self._recv("draft")[1]
        except BaseException:
            self.close()
            raise

    def run(self, request: dict):
        """Yields each chunk of new tokens; returns (via StopIteration.value) the metrics."""
        self.start()
        ssd = request["mode"] == "ssd"
        try:
            self._send("target", ("run", request))
            if ssd:
                self._send("draft", ("run", request))
            while True:
                kind, payload = self._recv("target")
                if kind == "chunk":
                    yield payload
                    continue
                metrics = metrics_from_dict(payload)
                break
            if ssd:
                _, draft_stats = self._recv("draft")
                if metrics.ssd is not None:
                    metrics.ssd.take_draft_side(SSDStats.from_dict(draft_stats))
            return metrics
        except GeneratorExit:
            # The caller stopped reading early (warmup, a closed stream): the workers still
            # finish the request, so drain their messages to keep the pool usable.
            self._drain(ssd)
            raise
        except BaseException:
            # A worker that failed mid-round leaves the other blocked in a collective: stop both.
            self.close()
            raise

    def live(self, mode: str, slots: int, spec, **kw):
        """A continuous batch of `slots` rows in the workers (runtime/pool_live.py)."""
        from ssd_jax.runtime.pool_live import WorkerLive
        self.start()
        return WorkerLive(self, mode, slots, spec, **kw)

    def live_call(self, roles: tuple[str, ...], msg: dict):
        """One live-batch call, made by the workers of `roles` in this order; the target
        worker's answer: (the call's result, the free slots after it)."""
        try:
            for role in roles:
                self._send(role, ("live", msg))
            return self._recv("target")[1]
        except BaseException:
            # A worker that failed mid-call leaves the other blocked in a collective, and a
            # call interrupted here leaves its answer unread: stop both.
            self.close()
            raise

    def live_end(self, roles: tuple[str, ...]) -> None:
        """End the workers' sides of a live batch (no answer comes back)."""
        if not self.conns:
            return  # closed after a failure
        try:
            for role in roles:
                self._send(role, ("live", dict(op="end")))
        except BaseException:
            self.close()
            raise

    def _drain(self, ssd: bool) -> None:
        try:
            while self._recv("target")[0] == "chunk":
                pass
            if ssd:
                self._recv("draft")
        except BaseException:
            self.close()

    def _send(self, role: str, msg) -> None:
        """Send to a worker; one that has died is a WorkerError naming it, as in `_recv`."""
        try:
            self.conns[role].send(msg)
        except OSError as e:
            self._check_alive()
            raise WorkerError(f"the {role} worker's connection failed: {e}") from e

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise WorkerError(f"the {name} worker exited with code {proc.returncode}"
                                  f"{self._error_of(name) or self._log_tail(name)}")

    def _error_of(self, role: str) -> str:
        """The traceback a dead worker sent and nobody read (the draft answers no live-batch
        call), or ""."""
        conn = self.conns.get(role)
        try:
            if conn is not None and conn.poll(0):
                kind, payload = conn.recv()
                if kind == "error":
                    return f":\n{payload}"
        except (EOFError, OSError, ValueError):
            pass
        return ""

    def _log_tail(self, role: str, lines: int = 15) -> str:
        f = self.logs.get(role)
        if f is None:
            return ""
        try:
            with open(f.name, "rb") as r:
                tail = r.read()[-4000:].decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"; the end of its log ({f.name}):\n" + "\n".join(tail) if tail else ""

    def _recv(self, role: str):
        conn = self.conns[role]
        while not conn.poll(1.0):
            self._check_alive()
        kind, payload = conn.recv()
        if kind == "error":
            # A worker whose partner died fails in their collective: name the death first.
            dead = [f"the {name} worker exited with code {proc.returncode}; "
                    for name, proc in self.procs.items()
                    if name != role and proc.poll() is not None]
            raise WorkerError(f"{''.join(dead)}the {role} worker failed:\n{payload}")
        return kind, payload

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send(("stop", None))
                conn.close()
            except OSError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.conns.clear()
        for f in self.logs.values():
            f.close()
            try:
                os.unlink(f.name)  # a clean stop leaves no log behind
            except OSError:
                pass
        self.logs.clear()
