"""Small process helpers shared by the worker pool, its workers, the pod launcher and the load
tool (no JAX import: the launcher and a child before exec use them)."""
from __future__ import annotations

import ctypes
import os
import signal
import socket


def free_port() -> int:
    """A TCP port on the loopback interface that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent dies (no orphans)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's atexit/terminate still cleans up


def pin_process(cores) -> None:
    """Run this process, every thread it has already started included, on `cores` only.
    sched_setaffinity(0, ...) binds the calling thread and the threads it starts later; a
    thread started before (numpy's BLAS pool: importing this package imports numpy) would keep
    every core, and wake on the other role's core."""
    cores = set(cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass  # the thread ended meanwhile
    os.sched_setaffinity(0, cores)
