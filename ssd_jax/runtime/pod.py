"""A pod: one `jax.distributed` job whose processes form a target group and a draft group.

Every host runs the same command. After `distributed.initialize()`, the device split
(`sharding.plan_split`, which gives the draft whole hosts) decides each process's role:

  target group   the processes holding the target mesh (tensor-parallel across them); all of
                 them run the target's programs SPMD. Its first process is the *lead*: it owns
                 requests and results (the Python API, CLI or server runs there).
  draft group    the processes holding the draft mesh; they run SSD's draft side.
  idle           processes with no device in either mesh (they wait for the end).

The lead publishes each request on JAX's coordination service (its key-value store); the
others follow (`Engine.follow`): every process of a group then runs the same decode loop over
its group's global mesh, and the groups exchange the round's messages through
`core.transport.GroupExchange`. AR and SD run on the target group alone. A server's continuous
batch is mirrored call by call on a `Stream` (runtime/pod_live.py); automatic settings are
measured by both groups at once (Engine._pod_step_costs).

Failure is loud: each process beats a counter in the store and watches the others'. The first
to see a beat stopped for `SSD_JAX_PEER_TIMEOUT_S` seconds (default 20) writes its verdict to
the store; every process prints that one line, naming the dead process, and exits with status 75
(also from inside a collective: no hang, no orphan). Process 0 holds JAX's coordination service:
if it dies, the others end through JAX's own error ("the JAX distributed service detected fatal
errors"), within seconds. JAX's heartbeat (set by `distributed.initialize`) is the last resort.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass

from ssd_jax.sharding import DeviceSplit

KEY = "ssd_jax/pod"
EXIT_PEER_LOST = 75  # EX_TEMPFAIL: another process of the job died


class PodError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pod:
    """Which process holds what, from the global device split."""

    split: DeviceSplit
    target_procs: tuple[int, ...]
    draft_procs: tuple[int, ...]
    process: int
    n_processes: int

    @classmethod
    def of(cls, split: DeviceSplit, process: int, n_processes: int) -> "Pod":
        procs = [tuple(sorted({d.process_index for d in m.devices.flat}))
                 for m in (split.target, split.draft)]
        shared = set(procs[0]) & set(procs[1])
        if shared:
            raise PodError(
                f"process(es) {sorted(shared)} would hold devices of both the target and the "
                f"draft mesh: in a multi-process job each process belongs to one group. Give "
                f"the draft whole processes (draft devices a multiple of the devices per "
                f"process), or run one process per device")
        return cls(split, procs[0], procs[1], process, n_processes)

    @property
    def lead(self) -> int:
        return self.target_procs[0]

    @property
    def is_lead(self) -> bool:
        return self.process == self.lead

    @property
    def is_group_lead(self) -> bool:
        """The first process of the target or the draft group: it compiles the programs its
        group's processes all compile (one SPMD program each), and writes them to the
        compilation cache (compile_cache.write_from_any_process)."""
        return self.process in (self.target_procs[0], self.draft_procs[0])

    def role_of(self, process: int) -> str:
        return ("target" if process in self.target_procs else
                "draft" if process in self.draft_procs else "idle")

    @property
    def role(self) -> str:
        return self.role_of(self.process)

    def name(self, process: int) -> str:
        lead = " lead" if process == self.lead else ""
        return f"process {process} ({self.role_of(process)} group{lead})"

    def describe(self) -> str:
        """One line per process: its group and its devices in the meshes."""
        lines = []
        for p in range(self.n_processes):
            held = []
            for side, mesh in (("target", self.split.target), ("draft", self.split.draft)):
                ids = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == p]
                if ids:
                    held.append(f"{side} TP-{mesh.devices.size} shards {ids}")
            lines.append(f"{self.name(p)}: {', '.join(held) or 'no devices in either mesh'}")
        return "\n".join(lines)


def _client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise PodError("a pod needs jax.distributed: call ssd_jax.runtime.distributed."
                       "initialize() first thing on every process (python -m ssd_jax.launch "
                       "starts a local job)")
    return client


def _die(message: str) -> None:
    print(f"ssd_jax: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)  # not sys.exit: JAX's shutdown barrier would wait for the dead


class Watchdog(threading.Thread):
    """Beats this process's counter and watches the others' (module docstring)."""

    def __init__(self, pod: Pod, period_s: float = 1.0, timeout_s: float | None = None):
        super().__init__(name="ssd_jax-pod-watchdog", daemon=True)
        self.pod, self.period = pod, period_s
        self.timeout = timeout_s or float(os.environ.get("SSD_JAX_PEER_TIMEOUT_S", "20"))
        self.client = _client()
        self.stopped = threading.Event()

    def verdict(self, dead: int, why: str) -> None:
        """Name the dead process for every other process (they read it on their next beat),
        then end this one. Process 0 holds JAX's coordination service, whose end kills the
        others at once: it lingers a few beats so that they read the verdict first."""
        me = self.pod.name(self.pod.process)
        line = f"{self.pod.name(dead)} {why}"
        try:
            self.client.key_value_set(f"{KEY}/dead", line)
        except Exception:  # noqa: BLE001 - another process said it first
            pass
        if self.pod.process == 0:
            time.sleep(3 * self.period)
        _die(f"{line}; {me} exits too")

    def run(self) -> None:
        me, beat = self.pod.process, 0
        seen: dict[int, tuple[str, float]] = {}
        start = time.monotonic()
        while not self.stopped.wait(self.period):
            beat += 1
            try:
                self.client.key_value_set(f"{KEY}/beat/{me}", str(beat), allow_overwrite=True)
                said = _try_get(self.client, f"{KEY}/dead")
                if said is not None:  # another process found the dead one
                    if self.pod.process == 0:
                        time.sleep(3 * self.period)
                    _die(f"{said}; {self.pod.name(me)} exits too")
                now = time.monotonic()
                for p in range(self.pod.n_processes):
                    if p == me or _try_get(self.client, f"{KEY}/bye/{p}") is not None:
                        continue
                    value = _try_get(self.client, f"{KEY}/beat/{p}") or ""
                    if p not in seen or seen[p][0] != value:
                        seen[p] = (value, now)
                    elif now - seen[p][1] > self.timeout and now - start > self.timeout:
                        self.verdict(p, f"stopped responding (no heartbeat for "
                                        f"{self.timeout:.0f} s): it has died or hangs")
            except Exception as e:  # noqa: BLE001 - the store itself is gone
                if self.stopped.is_set():
                    return
                _die(f"{self.pod.name(me)} lost the job's coordination service (held by "
                     f"process 0, {self.pod.role_of(0)} group): process 0 has died "
                     f"({type(e).__name__}: {str(e).splitlines()[0][:120]}); exiting")

    def stop(self) -> None:
        """A clean exit: the others stop watching this process."""
        try:
            self.client.key_value_set(f"{KEY}/bye/{self.pod.process}", "1",
                                      allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the job is ending anyway
            pass
        self.stopped.set()


_meetings = 0  # every process makes the same meet() calls in the same order


def meet(pod: Pod, what: str, timeout_s: float | None = None) -> None:
    """Wait until every process of the job has reached this point (a barrier on JAX's
    coordination service). Sized for start-up: a host can take minutes longer than another to
    get here (a slower disk, a bigger model to read), where a first collective would give up
    after 30 s (gloo's context set-up on CPU). A dead process ends the wait through the
    watchdog; a live one that never comes is named after `timeout_s`."""
    global _meetings
    timeout_s = timeout_s or float(os.environ.get("SSD_JAX_START_TIMEOUT_S", "900"))
    _meetings += 1
    try:
        _client().wait_at_barrier(f"{KEY}/meet/{_meetings}/{what}", int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - the service's error, restated
        text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise PodError(f"{pod.name(pod.process)}: not every process of the job reached "
                       f"'{what}' within {timeout_s:.0f} s ({text}); if a host is just slow to "
                       f"start, raise SSD_JAX_START_TIMEOUT_S") from e


def _try_get(client, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001 - NOT_FOUND is how a missing key is reported
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
            return None
        raise


class Control:
    """The lead's requests to the followers, and the followers' reports, in JAX's store."""

    def __init__(self, pod: Pod):
        self.pod, self.client = pod, _client()
        self.seq = 0

    def publish(self, message: dict) -> int:
        """Lead: the next message (a run, or stop). Returns its sequence number."""
        seq = self.seq
        self.client.key_value_set(f"{KEY}/msg/{seq}", json.dumps(message))
        self.seq += 1
        return seq

    def receive(self) -> dict:
        """Follower: wait for the lead's next message (the watchdog ends the wait if it dies)."""
        raw = _wait(self.client, f"{KEY}/msg/{self.seq}")
        self.seq += 1
        return json.loads(raw)

    def report(self, seq: int, payload: dict) -> None:
        self.client.key_value_set(f"{KEY}/report/{seq}/{self.pod.process}", json.dumps(payload))

    def collect(self, seq: int, process: int, timeout_s: float = 600.0) -> dict:
        return json.loads(self.client.blocking_key_value_get(f"{KEY}/report/{seq}/{process}",
                                                             int(timeout_s * 1000)))


def _wait(client, key: str) -> str:
    """Block until `key` is set (the watchdog ends this process if the writer dies)."""
    while True:
        try:
            return client.blocking_key_value_get(key, 5_000)
        except Exception as e:  # noqa: BLE001 - a timeout: keep waiting
            if "DEADLINE" not in str(e).upper() and "timed out" not in str(e).lower():
                raise


class Stream:
    """A sequence of messages from the lead to the processes that take part in one long-lived
    exchange (a server's live batch: every join, leave and round), read in order.

    A server makes one message per round for as long as it runs, so the lead deletes each
    message `keep` messages later (KEEP by default; pod_live.keep_for sizes it for a batch). That is safe because a reader is never that far behind: each
    round is a collective of every reader with the lead, so the lead cannot finish round n
    (and publish past it) before each reader has read message n, and between rounds the lead
    publishes at most one join or leave per slot."""

    KEEP = 1024

    def __init__(self, name: str, keep: int = KEEP):
        self.prefix, self.client, self.n, self.keep = f"{KEY}/{name}", _client(), 0, keep

    def publish(self, message: dict) -> None:
        self.client.key_value_set(f"{self.prefix}/{self.n}", json.dumps(message))
        if self.n >= self.keep:
            self.client.key_value_delete(f"{self.prefix}/{self.n - self.keep}")
        self.n += 1

    def receive(self) -> dict:
        raw = _wait(self.client, f"{self.prefix}/{self.n}")
        self.n += 1
        return json.loads(raw)
