"""Flag checks of the bench CLI: every bad value becomes one line that names the value and the
fix (BenchError, exit code 2); device split and engine settings for the ssd_jax engine."""
from __future__ import annotations

import dataclasses
import os

from bench.measure import Point
from bench.suites import SUITES


class BenchError(Exception):
    """A bad flag or set-up problem: printed as one line (with the fix), exit code 2."""


def suite_names(text: str, among: tuple[str, ...] | list[str], flag: str,
                what: str = "a suite") -> list[str]:
    """The suites a comma list names ("all": every one of `among`), in `among`'s order; a name
    not in `among` is one line naming the flag and the choices (--suite and --extras-suite)."""
    if text.strip() == "all":
        return list(among)
    named = [s.strip() for s in text.split(",")]
    for s in named:
        if s not in among:
            raise BenchError(f"{flag} {s!r} is not {what}: use one or more of "
                             f"{', '.join(among)}, or all")
    return [s for s in among if s in named]


def validate(args) -> tuple[list[str], list[Point]]:
    suites = suite_names(args.suite, SUITES, "--suite")
    for flag, v in (("--batch", args.batch), ("--num-prompts", args.num_prompts),
                    ("--output-len", args.output_len), ("--calib-prompts", args.calib_prompts),
                    ("--prefill-bucket", args.prefill_bucket), ("--sync-every", args.sync_every),
                    *[("--sweep-batch", b) for b in args.sweep_batch]):
        if v < 1:
            raise BenchError(f"{flag} {v} is invalid: it must be >= 1")
    biggest = max([args.batch, *args.sweep_batch])
    if biggest > args.num_prompts:
        raise BenchError(f"batch {biggest} is larger than --num-prompts {args.num_prompts}: a "
                         "batch is made of a suite's prompts; raise --num-prompts or lower "
                         "--batch / --sweep-batch")
    for k in [args.k, *args.sweep_k]:
        if k is not None and k < 1:
            raise BenchError(f"K={k} is invalid: lookahead must be >= 1 (--k / --sweep-k)")
    if args.k is None and (args.budget or args.sweep_budget) and not args.sweep_k:
        raise BenchError("--k auto chooses the budget with K: drop --budget / --sweep-budget, "
                         "or give K (--k N or --sweep-k)")
    if args.ar_fallback and args.k is not None:
        raise BenchError("--ar-fallback follows the engine's automatic choice: use it with "
                         "--k auto")
    if args.grid and not (args.sweep_k and args.sweep_budget):
        raise BenchError("--grid needs both --sweep-k and --sweep-budget")
    pairs = ([(k, m) for k in args.sweep_k for m in args.sweep_budget] if args.grid else
             [(args.k, b) for b in [args.budget, *args.sweep_budget]]
             + [(k, args.budget) for k in args.sweep_k])
    if args.grid:  # a grid keeps the (K, M) that are valid
        pairs = [(k, m) for k, m in pairs if m == 0 or m >= k + 1]
    for k, m in pairs:
        if k is not None and m and m < k + 1:
            raise BenchError(f"budget {m} is smaller than K+1={k + 1}: every accept length needs "
                             f"a branch; use --budget >= {k + 1} (or 0 for 2(K+1)) or a lower K")
    for t in [args.temperature, *args.sweep_temperature]:
        if t < 0:
            raise BenchError(f"temperature {t} is invalid: use 0 (greedy) or a value > 0")
    if not 0 < args.top_p <= 1:
        raise BenchError(f"--top-p {args.top_p} is invalid: it must lie in (0, 1]")
    for c in [args.c, *args.sweep_c]:
        if c is not None and not 0 < c <= 1:
            raise BenchError(f"C={c} is invalid: Saguaro's C must lie in (0, 1]")
    # With K given, the engine runs C=1 unless told: a --sweep-c beside it then compares with
    # the base's own C, which also keeps a swept C=1 from being timed twice.
    c = 1.0 if args.c is None and args.k is not None and args.sweep_c else args.c
    base = Point(k=args.k, budget=None if args.k is None else args.budget, fanout=args.fanout, c=c,
                 backup=args.backup or (None if args.k is None else "neural"),
                 temperature=args.temperature, top_p=args.top_p,
                 batch=args.batch)
    points = [base]
    if args.grid:
        points += [dataclasses.replace(base, k=k, budget=m) for k, m in pairs]
    sweeps = (("temperature", args.sweep_temperature), ("batch", args.sweep_batch),
              ("c", args.sweep_c))
    if not args.grid:
        sweeps = (("k", args.sweep_k), ("budget", args.sweep_budget)) + sweeps
    for field, values in sweeps:
        points += [dataclasses.replace(base, **{field: v}) for v in values]
    return list(suites), list(dict.fromkeys(points))


def extras_suites(args, suites: list[str]) -> list[str]:
    """The suites --all-cores and --peers run on (--extras-suite, default every suite of the
    run): those cells are reference points for a CPU user choosing a mode, and on a slow host
    they are most of a four-suite run's time (the Qwen pair: ~80 of ~200 min)."""
    if args.extras_suite is None:
        return suites
    return suite_names(args.extras_suite, suites, "--extras-suite", "a suite of this run")


def device_split(args) -> tuple[int, int] | None:
    """(target, draft) devices, checked against what this machine has."""
    if args.target_devices is None and args.draft_devices is None:
        return None
    split = tuple(1 if v is None else v for v in (args.target_devices, args.draft_devices))
    for flag, v in zip(("--target-devices", "--draft-devices"), split):
        if v < 1:
            raise BenchError(f"{flag} {v} is invalid: each side needs at least one device")
    need, cores = sum(split), len(os.sched_getaffinity(0))
    avail, kind = cores, "CPU cores"
    if args.driver != "processes":  # the processes driver must own jax's initialisation
        import jax
        if need <= cores:
            try:  # several CPU devices in one process; only possible before the first device use
                jax.config.update("jax_num_cpu_devices", need)
            except Exception:
                pass
        devices = jax.devices()
        if devices[0].platform != "cpu":
            avail, kind = len(devices), f"{devices[0].platform} devices"
    if need > avail:
        raise BenchError(f"device split --target-devices {split[0]} --draft-devices {split[1]} "
                         f"needs {need} devices but {avail} {kind} are available: lower the "
                         f"split to at most {avail} in total")
    return split


def engine_config(args, split, max_batch: int):
    from ssd_jax import EngineConfig
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kw = dict(max_batch=max_batch, max_seq_len=args.max_seq_len,
              prefill_bucket=args.prefill_bucket, sync_every=args.sync_every)
    if "driver" in fields:
        kw["driver"] = args.driver
    elif args.driver == "processes":
        raise BenchError("--driver processes needs EngineConfig(driver=...), which this ssd_jax "
                         "version lacks: use --driver single")
    if getattr(args, "draft_vocab", None) is not None:
        if "draft_vocab" not in fields:
            raise BenchError("--draft-vocab needs EngineConfig(draft_vocab=...), which this "
                             "ssd_jax version lacks: drop --draft-vocab")
        kw["draft_vocab"] = args.draft_vocab
    if not getattr(args, "cpu_kernels", True):
        if "cpu_kernels" not in fields:
            raise BenchError("--no-cpu-kernels needs EngineConfig(cpu_kernels=...), which this "
                             "ssd_jax version lacks: drop --no-cpu-kernels")
        kw["cpu_kernels"] = False
    if getattr(args, "draft_precision", "fp32") != "fp32":
        if "draft_precision" not in fields:
            raise BenchError("--draft-precision needs EngineConfig(draft_precision=...), which "
                             "this ssd_jax version lacks: drop --draft-precision")
        kw["draft_precision"] = args.draft_precision
    if split is not None:
        if "mesh" not in fields:
            raise BenchError("--target-devices/--draft-devices need EngineConfig(mesh=...), which "
                             "this ssd_jax version lacks: drop the device-split flags")
        kw["mesh"] = split
    try:
        return EngineConfig(**kw)
    except (ValueError, TypeError) as e:
        raise BenchError(str(e))
