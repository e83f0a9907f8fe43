"""The XLA:CPU flags the entry points set: wide vectors only on AVX-512 CPUs and only when the
user chose no width; worker and launched processes keep the user's flags."""
from ssd_jax.xla_cpu import WIDE_VECTORS, has_avx512, prefer_wide_vectors, with_device_count

AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_avx512_is_read_from_the_flags_line():
    assert has_avx512(AVX512)
    assert not has_avx512(AVX2)
    assert not has_avx512("model name\t: avx512f in a name\n")
    assert not has_avx512("flags\t\t: avx2 avx512_vnni\n")


def test_wide_vectors_are_added_after_the_users_flags():
    env = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
    assert prefer_wide_vectors(env, AVX512)
    assert env["XLA_FLAGS"] == f"--xla_cpu_multi_thread_eigen=false {WIDE_VECTORS}"
    assert not prefer_wide_vectors(env, AVX512)  # once only
    assert env["XLA_FLAGS"].count("vector_width") == 1
    empty = {}
    assert prefer_wide_vectors(empty, AVX512) and empty["XLA_FLAGS"] == WIDE_VECTORS


def test_a_users_width_wins_and_other_cpus_are_left_alone():
    env = {"XLA_FLAGS": "--xla_cpu_prefer_vector_width=256"}
    assert not prefer_wide_vectors(env, AVX512)
    assert env["XLA_FLAGS"] == "--xla_cpu_prefer_vector_width=256"
    env = {}
    assert not prefer_wide_vectors(env, AVX2) and "XLA_FLAGS" not in env


def test_device_count_is_replaced_and_other_flags_kept():
    flags = f"--xla_force_host_platform_device_count=8 {WIDE_VECTORS}"
    assert with_device_count(flags, 2) == f"{WIDE_VECTORS} --xla_force_host_platform_device_count=2"
    assert with_device_count(flags, 1) == WIDE_VECTORS
    assert with_device_count("", None) == ""
