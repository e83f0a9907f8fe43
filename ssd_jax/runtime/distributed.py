"""Multi-host start-up: join `jax.distributed` when the environment describes a multi-process job.

Every host of a pod or cluster runs the same command; `initialize()` (called explicitly by the
`python -m ssd_jax` job, by `ssd-bench`, and by user code first thing, before anything touches a
device; `LLM(...)` does not call it) reads, in order:

  SSD_JAX_DISTRIBUTED=0                       never initialise (single-host runs, debugging)
  SSD_JAX_COORDINATOR / JAX_COORDINATOR_ADDRESS  host:port of process 0, with
  SSD_JAX_NUM_PROCESSES / JAX_NUM_PROCESSES      the process count and
  SSD_JAX_PROCESS_ID / JAX_PROCESS_ID            this process's index (all three, or an error)
  a multi-task Slurm job, an Open MPI launch,
  or a multi-host Cloud TPU slice             jax.distributed.initialize() with no arguments:
                                              JAX's own cluster detection fills them in

and otherwise leaves JAX single-process. After it, `jax.devices()` lists every host's devices
and `sharding.split_devices` can give the draft whole hosts of its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class ClusterEnv:
    """What `initialize` will pass to jax.distributed.initialize (None = JAX detects it)."""

    source: str
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _first(env: Mapping[str, str], *names: str) -> tuple[str | None, str | None]:
    for n in names:
        if env.get(n):
            return n, env[n]
    return None, None


def detect(env: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """The multi-process job this environment describes, or None for a single process."""
    env = os.environ if env is None else env
    if env.get("SSD_JAX_DISTRIBUTED", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    _, coordinator = _first(env, "SSD_JAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
    if coordinator:
        values = {}
        for key, names in (("num_processes", ("SSD_JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES")),
                           ("process_id", ("SSD_JAX_PROCESS_ID", "JAX_PROCESS_ID"))):
            name, raw = _first(env, *names)
            if raw is None:
                raise ValueError(f"a coordinator address is set ({coordinator}) but not "
                                 f"{names[0]}: set it on every host (process ids 0..N-1)")
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None
        n, pid = values["num_processes"], values["process_id"]
        if n < 1 or not 0 <= pid < n:
            raise ValueError(f"process id {pid} is outside 0..{n - 1}: each of the {n} "
                             f"processes needs a distinct id below {n}")
        return ClusterEnv("environment", coordinator, n, pid)
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return ClusterEnv("slurm")
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return ClusterEnv("open-mpi")
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        return ClusterEnv("cloud-tpu")
    return None


def initialize(env: Mapping[str, str] | None = None) -> bool:
    """Join the multi-process job if the environment describes one; True if JAX is now
    distributed. Idempotent. Must run before the first JAX computation of the process."""
    import jax

    if jax.distributed.is_initialized():
        return True
    cluster = detect(env)
    if cluster is None:
        return False
    # CPU processes need a collectives backend for cross-process programs (no effect on GPU/TPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {k: v for k, v in (("coordinator_address", cluster.coordinator),
                                ("num_processes", cluster.num_processes),
                                ("process_id", cluster.process_id)) if v is not None}
    # JAX's own heartbeat ends the job when a process dies (after 100 s by default); ours
    # (runtime/pod.py) answers in ~20 s with a clearer line, this is the second line of defence.
    kwargs["heartbeat_timeout_seconds"] = int(os.environ.get("SSD_JAX_HEARTBEAT_S", "45"))
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        if "before any JAX" in str(e) or "already" in str(e):
            raise RuntimeError(
                f"this looks like a multi-process job ({cluster.source}) but JAX was already "
                f"used in this process: call ssd_jax.runtime.distributed.initialize() first thing, or "
                f"set SSD_JAX_DISTRIBUTED=0 to run single-process") from e
        raise
    return True
