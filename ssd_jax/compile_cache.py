"""XLA's persistent compilation cache, on by default: a second run of a pair skips most of its
compiles.

Start-up on the real pair is loading and compiling, and every run of the same pair, shapes
and settings compiles the same programs. JAX can keep compiled executables on disk keyed by
the program, the compile options, the XLA flags and the JAX version; this turns that on for
every ssd-jax entry point (`LLM`, the CLI, the server, the bench, the worker processes).

Where: `$SSD_JAX_COMPILE_CACHE` if set ("off" turns it off), else `xla/<cpu>` under the model
cache (`~/.cache/ssd_jax`). `<cpu>` names this machine's processor and its instruction-set
flags, so a home directory shared between machines never hands one CPU's code to another.
A cache directory the user already gave JAX (`jax_compilation_cache_dir`) is left as it is.
The directory is bounded (least recently used entries go first) and holds compiled code that
JAX runs without checking: like JAX's own cache, it must not be writable by anyone else.

JAX writes entries from process 0 only, a guard for many hosts sharing one remote store. The
two worker processes of the CPU driver share one machine and a file-locked local directory,
and the draft worker (process 1) compiles programs of its own: `write_from_any_process` lets
it write them too, or SSD's start-up, which waits for the slower worker, would hardly gain. A
pod's draft group is the same case: its first process writes its programs (runtime/pod.py's
`is_group_lead`).
"""
from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Mapping
from pathlib import Path

from ssd_jax.xla_cpu import read_cpuinfo

ENV = "SSD_JAX_COMPILE_CACHE"
OFF = ("", "0", "off", "none", "false")
# The real pair's SD programs took 1.3 MB here (executables, not weights): the bound is for a
# long life of many shapes and settings.
MAX_BYTES = 2 << 30
# Programs that compile faster than this are not worth a disk read and a file each.
MIN_COMPILE_S = 0.5


def cpu_fingerprint(cpuinfo: str | None = None) -> str:
    """A short name for this machine's processor model and instruction-set flags."""
    lines = (read_cpuinfo() if cpuinfo is None else cpuinfo).splitlines()
    model = next((ln for ln in lines if ln.startswith("model name")), "")
    flags = next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
    what = f"{platform.machine()}|{platform.processor()}|{model}|{flags}"
    return hashlib.sha1(what.encode()).hexdigest()[:12]


def cache_dir(environ: Mapping[str, str] = os.environ, models: Path | None = None,
              cpuinfo: str | None = None) -> Path | None:
    """Where compiled programs are kept (under `models`, the model cache, when no directory is
    named in the environment), or None when the user turned the cache off."""
    if ENV in environ:
        value = environ[ENV].strip()
        return None if value.lower() in OFF else Path(value).expanduser()
    if models is None:
        from ssd_jax.loading.packaged import DEFAULT_CACHE as models
    return Path(models) / "xla" / cpu_fingerprint(cpuinfo)


def enable(environ: Mapping[str, str] = os.environ, models: Path | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at `cache_dir()`; returns the directory in use
    (the user's own if they set one), or None when off or not creatable. Safe to call again,
    and after programs have already compiled (later compiles use the cache)."""
    import jax
    own = jax.config.jax_compilation_cache_dir
    if own:
        return Path(own)
    path = cache_dir(environ, models)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None  # a read-only home: compile every time, as without the cache
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path


def write_from_any_process() -> bool:
    """Let this process write cache entries although it is not JAX's process 0 (see the module
    note). Only for a process whose cache directory is local (the workers'), and only for a
    bounded cache: its file lock orders two processes writing one entry (an unbounded one,
    such as a directory the user gave JAX, has none). Returns False where it does not apply or
    this JAX has no such hook; the process then compiles as before."""
    import jax
    from jax._src import compiler, distributed
    if jax.config.jax_compilation_cache_max_size <= 0:
        return False
    write = getattr(compiler, "_cache_write", None)
    if write is None or getattr(write, "any_process", False):
        return write is not None

    def as_process_zero(*args, **kwargs):
        # JAX's writer returns early unless the process id reads 0; it reads nothing else of
        # the distributed state, and the workers compile on one thread.
        state = distributed.global_state
        saved, state.process_id = state.process_id, 0
        try:
            return write(*args, **kwargs)
        finally:
            state.process_id = saved

    as_process_zero.any_process = True
    compiler._cache_write = as_process_zero
    return True
