"""The persistent compilation cache: where it goes, how it is turned off, and that a second
process really reads what the first compiled (JAX's own cache-hit counter, not a timing)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ssd_jax import compile_cache

AVX512 = "model name\t: Some CPU\nflags\t\t: fpu sse avx2 avx512f\n"
AVX2 = "model name\t: Some CPU\nflags\t\t: fpu sse avx2\n"


def test_the_directory_follows_the_environment_and_the_cpu(tmp_path):
    assert compile_cache.cache_dir({compile_cache.ENV: str(tmp_path)}) == tmp_path
    for off in ("off", "0", "", "None"):
        assert compile_cache.cache_dir({compile_cache.ENV: off}) is None
    under = compile_cache.cache_dir({}, models=tmp_path, cpuinfo=AVX512)
    assert under.parent == tmp_path / "xla"
    # Another instruction set, another directory: a shared home never hands one CPU's code to
    # another.
    assert compile_cache.cache_dir({}, models=tmp_path, cpuinfo=AVX2) != under
    assert compile_cache.cache_dir({}, models=tmp_path, cpuinfo=AVX512) == under


# The same program in two fresh processes; the second must load the first's executable. The
# child caches programs of any compile time (this one compiles faster than MIN_COMPILE_S).
_CHILD = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax._src import monitoring
    from ssd_jax import compile_cache
    hits = []
    monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
    print("DIR", compile_cache.enable())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))))
    print("HITS", len(hits))
""")


def _child(env: dict) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if line[:4] in ("DIR ", "HITS"))


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env[compile_cache.ENV] = str(tmp_path / "xla")
    first, second = _child(env), _child(env)
    assert first == {"DIR": str(tmp_path / "xla"), "HITS": "0"}
    assert int(second["HITS"]) >= 1
    assert any(p.name.endswith("-cache") for p in (tmp_path / "xla").iterdir())
    env[compile_cache.ENV] = "off"
    assert _child(env) == {"DIR": "None", "HITS": "0"}


def test_a_directory_the_user_gave_jax_is_kept(tmp_path):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "theirs"))
    env[compile_cache.ENV] = str(tmp_path / "ours")
    assert _child(env)["DIR"] == str(tmp_path / "theirs")
    assert not Path(tmp_path / "ours").exists()


# A process that JAX numbers 1 (as the draft worker is): JAX alone writes nothing from it.
_PROCESS_ONE = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jax._src import distributed
    from ssd_jax import compile_cache
    compile_cache.enable()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    distributed.global_state.process_id = 1
    if sys.argv[1] == "unbounded":  # no file lock to order the writers: JAX's rule stands
        jax.config.update("jax_compilation_cache_max_size", -1)
        assert not compile_cache.write_from_any_process()
    if sys.argv[1] == "patched":
        assert compile_cache.write_from_any_process()
    jax.block_until_ready(jax.jit(lambda x: jnp.cos(x) @ x.T)(jnp.ones((8, 8))))
    assert distributed.global_state.process_id == 1
""")


def test_the_draft_worker_writes_its_programs_too(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    hows = ("plain", "unbounded", "patched")
    for how in hows:
        env[compile_cache.ENV] = str(tmp_path / how)
        subprocess.run([sys.executable, "-c", _PROCESS_ONE, how], env=env, timeout=300,
                       check=True)
    written = {how: [p for p in (tmp_path / how).iterdir() if p.name.endswith("-cache")]
               for how in hows}
    assert written["plain"] == written["unbounded"] == [] and written["patched"]
