"""Small process helpers shared by the worker pool, its workers, the pod launcher and the load
tool (no JAX import: the launcher and a child before exec use them)."""
from __future__ import annotations

import ctypes
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
