"""ssd-bench: AR vs SD vs SSD decode throughput on offline prompt suites, with sweeps, peers,
a markdown table, JSON and plots.

    ssd-bench --mode all --suite all --num-prompts 8 --output-len 64 --peers --out results/
    ssd-bench --mode ssd --suite code --sweep-k 2,3,4 --sweep-temperature 0,0.5,1 --json r.json
    ssd-bench report results/bench.json --readme README.md   # regenerate the README section
    ssd-bench plan ...                                        # bench/plan.py

Protocol (the SSD paper's): batch 1, greedy, decode tok/s with prefill excluded (total decode
tokens / total decode seconds over the prompts), every compiled shape warmed up before timing.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from bench.checks import BenchError, device_split, engine_config, extras_suites, validate
from bench.measure import Cells, Point, encode
from bench.suites import SUITES, load_suite
from ssd_jax.__main__ import parse_lookahead

MODES = ("ar", "sd", "ssd")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(f"{message} (see ssd-bench --help)")


def _list(kind, flag):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of {kind.__name__}s, e.g. {flag} 2,3,4")
    return parse


# --pair name -> (target, draft)
PAIRS = {"smollm2": ("smollm2", "smollm2-draft"),
         "qwen2.5-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="ssd-bench", description=__doc__.split("\n\n")[0],
                 epilog="Subcommands: `ssd-bench report JSON [--readme FILE]`, `ssd-bench plan`, "
                 "`ssd-bench serve` (load on the OpenAI server).",
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = ap.add_argument
    a("--mode", default="all", choices=[*MODES, "all"], help="decode mode(s) to time")
    a("--pair", default="smollm2", choices=sorted(PAIRS),
      help="model pair: smollm2 (SmolLM2-135M + our 5M distilled draft, fast) or qwen2.5-coder "
      "(Qwen2.5-Coder-1.5B-Instruct + 0.5B-Instruct, from PyPI); --target/--draft override")
    a("--target", default=None, help="name, .gguf file, HF directory or orbax directory")
    a("--draft", default=None, help="draft model (same kinds as --target)")
    a("--k", type=parse_lookahead, default=4,
      help="lookahead K: draft tokens per round, or auto (K, M and the backup chosen by the "
      "engine's speed model from step costs it measures once per machine and pair)")
    a("--fanout", default="geometric", choices=["uniform", "geometric", "empirical"])
    a("--budget", type=int, default=0, help="SSD branches per row M (0: 2(K+1))")
    a("--c", type=float, default=None,
      help="Saguaro sampling constant C in (0, 1] (default: chosen with --k auto, else 1)")
    a("--backup", default=None, choices=["neural", "fast", "auto"],
      help="SSD backup on a cache miss (default: neural; with --k auto, chosen with K)")
    a("--temperature", type=float, default=0.0, help="0 = greedy")
    a("--top-p", type=float, default=1.0)
    a("--batch", type=int, default=1)
    a("--num-prompts", type=int, default=8, help="prompts per suite")
    a("--output-len", type=int, default=64, help="new tokens per prompt")
    a("--suite", default="all", help=f"{', '.join(SUITES)}, a comma list of them, or all")
    a("--seed", type=int, default=0, help="prompt order and sampling seeds")
    a("--target-devices", type=int, default=None, help="devices of the target mesh")
    a("--draft-devices", type=int, default=None, help="devices of the draft mesh")
    a("--driver", default="auto", choices=["auto", "single", "processes"],
      help="SSD driver: one controller, or draft and target in two pinned processes")
    a("--draft-vocab", type=int, default=None, metavar="N",
      help="cut the draft's LM head to N columns: its most frequent tokens (a cheaper draft step for a large vocabulary, e.g. 32768 of Qwen2.5's 151936; lossless)")
    a("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
      help="use XLA's matrix products on a CPU, not ssd-jax's kernel for a few rows (slower: for A/B runs)")
    a("--draft-precision", default="fp32", choices=["fp32", "bf16"],
      help="the draft's form on the CPU kernel: bf16 weights and inputs, fp32 sums (~1.7x cheaper draft steps; lossless)")
    a("--sweep-k", type=_list(int, "--sweep-k"), default=[], metavar="K,K,...")
    a("--sweep-budget", type=_list(int, "--sweep-budget"), default=[], metavar="M,M,...")
    a("--sweep-temperature", type=_list(float, "--sweep-temperature"), default=[],
      metavar="T,T,...")
    a("--sweep-batch", type=_list(int, "--sweep-batch"), default=[], metavar="B,B,...")
    a("--sweep-c", type=_list(float, "--sweep-c"), default=[], metavar="C,C,...",
      help="Saguaro constants to time (SSD at T > 0)")
    a("--grid", action="store_true",
      help="sweep every (K, M) of --sweep-k x --sweep-budget, not each list on its own")
    a("--interleave", action="store_true",
      help="time the cells batch by batch in turn (prompt 1 of every cell, then prompt 2, ...; "
      "probes and compiles first) so that the machine's drift over the run falls on every "
      "cell alike: for comparing modes or settings on a VM whose speed moves within an hour")
    a("--all-cores", action="store_true",
      help="with worker processes: also time AR and SD in one process over all usable cores "
      "(what a CPU user without SSD would run), as modes ar-all and sd-all")
    a("--ar-fallback", action="store_true",
      help="with --k auto: SD/SSD cells whose automatic choice the speed model predicts slower "
      "than AR decode as SpecConfig(ar_fallback=True) does (AR calls, a speculative one now "
      "and then); each such cell reports how many answers ran AR")
    a("--peers", action="store_true",
      help="also time transformers AR and transformers assisted generation (our draft)")
    a("--extras-suite", default=None, metavar="SUITE,...",
      help="suites that --all-cores and --peers run on: a comma list or all (default: every "
           "suite of the run)")
    a("--torch-threads", type=int, default=None,
      help="torch threads for --peers (default: the cores the target gets)")
    a("--no-phases", action="store_true",
      help="skip the phase-timing pass that feeds the speed model")
    a("--calib-prompts", type=int, default=2, help="prompts of the phase-timing pass")
    a("--stop-at-eos", action="store_true",
      help="stop rows at EOS (default: always generate --output-len tokens)")
    a("--prefill-bucket", type=int, default=128,
      help="prompts are padded to a multiple of this: 128 puts every suite prompt of SmolLM2 "
      "in one compiled shape (TTFT includes the padding)")
    a("--sync-every", type=int, default=2,
      help="rounds dispatched before the host reads tokens: rounds past a request's last token "
      "are still timed, so keep it small (the engine default of 8 wastes up to 7 rounds)")
    a("--max-seq-len", type=int, default=4096)
    a("--dtype", default="float32", choices=["float32", "bfloat16"])
    a("--json", default=None, metavar="PATH", help="write the results JSON here")
    a("--out", default=None, metavar="DIR", help="write bench.json, results.md and PNG plots")
    a("--readme", default=None, metavar="FILE", help="replace this file's results section")
    a("--no-progress", action="store_true")
    return ap


# ------------------------------------------------------------------ the run
def machine() -> dict:
    import importlib.metadata as md
    versions = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "ssd-jax", "numpy", "torch", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    import collections
    import jax
    n = collections.Counter(f"{d.platform}:{d.device_kind}" for d in jax.devices())
    devices = ", ".join(f"{c}x {k}" for k, c in n.items())
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_model=_cpu_model(), cpu_count=os.cpu_count(),
                usable_cores=len(os.sched_getaffinity(0)),
                devices=devices, versions=versions, xla_flags=os.environ.get("XLA_FLAGS", ""),
                date=time.strftime("%Y-%m-%d %H:%M"), commit=_commit())


def _commit() -> str | None:
    """The checkout's git commit (None outside one): runs merged into one report may have
    been made at different commits, and their results say which."""
    import subprocess
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _cpu_model() -> str | None:
    """The CPU's model name: two VMs of one size on different hosts ran the real pair at
    speeds 2x apart here (an Intel Xeon's and an AMD EPYC's), which `processor` (x86_64)
    does not tell apart."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else (platform.processor() or None)


def run(args, argv) -> dict:
    args.target = args.target or PAIRS[args.pair][0]
    args.draft = args.draft or PAIRS[args.pair][1]
    suites, points = validate(args)
    extras = extras_suites(args, suites)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    needs_draft = any(m != "ar" for m in modes)
    load_draft = needs_draft or args.driver == "processes"  # the workers load both models
    prompts = {}
    for s in suites:
        try:
            prompts[s] = load_suite(s, args.num_prompts, args.seed)
        except ValueError as e:
            raise BenchError(str(e))
    split = device_split(args)
    machine_at_start = machine()  # not at the end: a long run's conditions are its start's
    if load_draft and args.draft.lower() == "smollm2-draft":
        from ssd_jax.loading.registry import SHIPPED
        if not SHIPPED["smollm2-draft"].exists():
            raise BenchError(f"the default draft is not at {SHIPPED['smollm2-draft']} yet (made by "
                             "`python -m ssd_jax.distill`): pass --draft smollm2 (the target as "
                             "its own draft) or another draft")
    engine = engine_config(args, split, max(p.batch for p in points))
    from ssd_jax import LLM

    def make_llm(engine):
        try:
            return LLM(args.target, draft=args.draft if load_draft else None, dtype=args.dtype,
                       spec=points[0].spec(), engine=engine, progress=not args.no_progress)
        except (FileNotFoundError, ValueError) as e:
            raise BenchError(str(e).splitlines()[0])

    llm = make_llm(engine)
    notes = []
    if (args.driver == "auto" and "ssd" in modes and callable(getattr(llm, "driver", None))
            and llm.driver("ssd") == "processes"):
        # The engine runs SSD in two pinned processes here; run AR and SD in the same target
        # process too, so that every mode's target gets the same single core (an LLM reads
        # no weights until its first run, so building a second one is cheap).
        llm.close()
        llm = make_llm(dataclasses.replace(engine, driver="processes"))
        notes.append("driver auto chose pinned worker processes for SSD on this CPU, so every "
                     "mode ran in them: the target gets one core in AR, SD and SSD, and SSD "
                     "adds a second core for the draft.")
    driver = llm.driver("ssd" if "ssd" in modes else modes[0]) if callable(
        getattr(llm, "driver", None)) else "single"
    if args.driver == "auto" and "ssd" not in modes and driver == "single" and split is None:
        import jax
        if jax.default_backend() == "cpu":
            # A run of AR or SD alone is not timed like a --mode all run (or an SSD cell),
            # where the target gets one pinned core: comparing the two misleads by ~2x.
            notes.append(f"{'/'.join(m.upper() for m in modes)} ran in the bench's own "
                         f"process on all {len(os.sched_getaffinity(0))} usable cores; an SSD "
                         "run (and --mode all) pins the target to one core, so pass --driver "
                         "processes to time it the same way.")
            print(f"ssd-bench: {notes[-1]}", file=sys.stderr)
    ids, how = {}, None
    for s in suites:
        ids[s], how = encode(llm, prompts[s])
    cells = Cells(llm, out_len=args.output_len, seed=args.seed,
                  ignore_eos=not args.stop_at_eos, progress=not args.no_progress,
                  ar_fallback=args.ar_fallback)
    jobs, seen = [], set()
    for point in points:
        for mode in modes:
            key = (mode, point.for_mode(mode))
            if key not in seen:
                seen.add(key)
                jobs += [(mode, point, s) for s in suites]
    from tqdm import tqdm
    out_cells, calibration = [], []

    def calibrate(mode, point, suite, cell) -> None:
        if (mode != "ar" and not args.no_phases and suite == suites[0]
                and cell["phases"] is None):
            n = max(args.calib_prompts, point.batch)
            calibration.append(dict(mode=mode, point=dataclasses.asdict(point.for_mode(mode)),
                                    phases=cells.calibrate(mode, point, ids[suite][:n])))

    try:
        if args.interleave:
            bar = tqdm(total=sum(len(ids[s]) for _, _, s in jobs), desc="prompts (interleaved)",
                       unit="prompt", disable=args.no_progress, file=sys.stderr)
            out_cells = cells.run_interleaved([(m, s, p, ids[s]) for m, p, s in jobs], bar)
            bar.close()
            for (mode, point, suite), cell in zip(jobs, out_cells):
                calibrate(mode, point, suite, cell)
        else:
            bar = tqdm(jobs, desc="cells", unit="cell", disable=args.no_progress, file=sys.stderr)
            for mode, point, suite in bar:
                bar.set_postfix_str(f"{mode} {suite} K={point.k} T={point.temperature:g} "
                                    f"B={point.batch}")
                cell = cells.run(mode, suite, point, ids[suite], desc=f"{mode}/{suite}")
                out_cells.append(cell)
                calibrate(mode, point, suite, cell)
    finally:
        if hasattr(llm, "close"):
            llm.close()
    if args.out:  # a checkpoint of the main cells, before the add-ons run
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cells_partial.json").write_text(json.dumps(out_cells, indent=1))

    def extra(what: str, fn) -> list[dict]:
        # A failing add-on (peers need transformers' GGUF reader, all-cores a second engine)
        # must not lose the main cells already measured: it becomes a note.
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported in the results' notes
            notes.append(f"{what} failed and is missing: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}")
            print(f"ssd-bench: {notes[-1]}", file=sys.stderr)
            return []

    if args.all_cores and driver == "processes":
        out_cells += extra("--all-cores", lambda: run_all_cores(
            args, make_llm, engine, points, modes, extras, ids))
        notes.append(f"ar-all / sd-all: AR and SD in the bench's own process on all "
                     f"{len(os.sched_getaffinity(0))} usable cores (XLA:CPU spreads each "
                     "computation over them), the choice of a CPU user without SSD.")
    if (args.all_cores or args.peers) and extras != suites:
        notes.append(f"The --all-cores and --peers cells ran on {', '.join(extras)} only "
                     "(--extras-suite).")
    threads = args.torch_threads or (1 if driver == "processes" else os.cpu_count())
    if args.peers:
        chosen = [c["k"] for c in out_cells if c["mode"] == "sd" and c.get("automatic")
                  and c["k"] is not None]
        out_cells += extra("--peers", lambda: run_peers(
            args, points[0], extras, ids, needs_draft, threads,
            peer_k=chosen[0] if chosen else 4))
    if driver != "processes" and "ssd" in modes:
        import jax
        if split is None or jax.devices()[0].platform == "cpu":
            notes.append("SSD ran with the single-controller driver"
                         + (" on CPU devices of one process" if split else "") + ": draft and "
                         "target share the same cores, so the draft's work is not overlapped "
                         "with verification (the speed model assumes it is).")
    for c in out_cells:
        if c.get("ar_fallback_answers") is not None:
            p = c["settings"]["predicted"]
            notes.append(f"{c['mode'].upper()} on {c['suite']} (--ar-fallback, K={c['k']}): the "
                         f"engine decoded {c['ar_fallback_answers']} of {c['num_prompts']} "
                         f"answers with AR (in order: {_runs(c['ar_fallback_calls'])}), each "
                         f"call deciding with what the calls before it had taught the speed "
                         f"model (at the pin: {c['mode'].upper()} {p[c['mode']]:.1f} tok/s, "
                         f"AR {p['ar']:.1f}).")
    if args.interleave and len(jobs) > 1:
        notes.append("The cells were timed batch by batch in turn (--interleave): the "
                      "machine's drift during the run fell on every cell alike.")
    if needs_draft and args.draft == args.target:
        notes.append("The draft is the target itself (a stand-in for a distilled draft).")
    if args.peers:
        notes.append(f"transformers peers ran with torch {threads} thread(s), batch 1.")
    results = dict(
        schema="ssd-bench/1", command="ssd-bench " + shlex.join(_portable(argv)),
        machine=machine_at_start,
        config=dict(target=args.target, draft=args.draft if needs_draft else None,
                    suites=suites, modes=modes, num_prompts=args.num_prompts,
                    output_len=args.output_len, seed=args.seed, driver=driver,
                    device_split=split, prefill_bucket=args.prefill_bucket,
                    sync_every=args.sync_every, dtype=args.dtype, draft_vocab=args.draft_vocab,
                    cpu_kernels=args.cpu_kernels, ignore_eos=not args.stop_at_eos,
                    prompt_encoding=how,
                    interleaved=args.interleave,
                    torch_threads=threads if args.peers else None),
        base=dataclasses.asdict(points[0]), points=[dataclasses.asdict(p) for p in points],
        cells=out_cells, calibration=calibration, notes=notes, plots=[])
    from bench.results import annotate
    return annotate(results)


def run_all_cores(args, make_llm, engine, points, modes, suites, ids) -> list[dict]:
    """AR and SD cells (base point) in this process with every usable core."""
    llm = make_llm(dataclasses.replace(engine, driver="single"))
    cells = Cells(llm, out_len=args.output_len, seed=args.seed,
                  ignore_eos=not args.stop_at_eos, progress=not args.no_progress)
    out = []
    try:
        for mode in [m for m in ("ar", "sd") if m in modes]:
            for s in suites:
                cell = cells.run(mode, s, points[0], ids[s], desc=f"{mode}-all/{s}")
                out.append(dict(cell, mode=f"{mode}-all", driver="single"))
    finally:
        llm.close()
    return out


def run_peers(args, base: Point, suites, ids, with_draft: bool, threads: int,
              peer_k: int = 4) -> list[dict]:
    """transformers AR and assisted generation; `peer_k`: assisted's K when ours was chosen
    automatically (the K our SD chose)."""
    import tempfile
    from bench.peers import TorchPeers
    work = Path(args.out) / "hf" if args.out else Path(tempfile.mkdtemp(prefix="ssd-bench-"))
    base = dataclasses.replace(base, k=base.k or peer_k)
    peers = TorchPeers(args.target, args.draft if with_draft else None, work, k=base.k,
                       threads=threads)
    out = []
    for mode in ["hf-ar"] + (["hf-assisted"] if with_draft else []):
        for s in suites:
            out.append(peers.run(mode, s, base, ids[s], out_len=args.output_len, seed=args.seed,
                                 ignore_eos=not args.stop_at_eos,
                                 desc="" if args.no_progress else f"{mode}/{s}"))
    return out


def report(results: dict, args) -> None:
    from bench.results import detail_table, save_dir, section, summary_table, update_readme

    def save_json() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1))

    save_json()  # the measurements first: nothing that may fail on them (plots) loses them
    if args.out:
        save_dir(results, Path(args.out))
        save_json()  # with the plots' names
    if args.readme:
        plot_dir = (os.path.relpath(Path(args.out).resolve(), Path(args.readme).resolve().parent)
                    if args.out else None)
        update_readme(Path(args.readme), section(results, plot_dir))
    print(summary_table(results))
    print()
    print(detail_table(results))
    for c in results["cells"]:
        if c.get("matches_ar") and c["matches_ar"][0] != c["matches_ar"][1]:
            print(f"warning: greedy {c['mode']} on {c['suite']} differs from AR on "
                  f"{c['matches_ar'][1] - c['matches_ar'][0]} of {c['matches_ar'][1]} prompts",
                  file=sys.stderr)


def _plan(argv) -> int:
    try:
        from bench import plan
    except ModuleNotFoundError as e:
        if e.name != "bench.plan":
            raise
        print("ssd-bench: error: `ssd-bench plan` is not available: bench/plan.py is missing "
              "from this checkout", file=sys.stderr)
        return 2
    return plan.main(argv)


def _runs(calls: list[dict]) -> str:
    """A fallback cell's calls in order, as runs of one mode: "7 SD, 1 AR"."""
    return ", ".join(f"{sum(c['answers'] for c in run)} {mode.upper()}"
                     for mode, run in itertools.groupby(calls, key=lambda c: c["mode"]))


def main(argv=None) -> int:
    from ssd_jax.xla_cpu import prefer_wide_vectors
    prefer_wide_vectors()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
    if argv[:1] == ["serve"]:
        from bench.serve_load import main as serve_main
        return serve_main(argv[1:])
    if argv[:1] == ["report"]:
        from bench.results import main as report_main
        return report_main(argv[1:])
    if argv[:1] == ["run"]:
        argv = argv[1:]
    try:
        args = parser().parse_args(argv)
        from ssd_jax.__main__ import quiet_logging
        quiet_logging()  # the library's status lines (worker start-up, downloads) on stderr
        from ssd_jax.runtime import distributed
        distributed.initialize()  # multi-host jobs: before machine() or a model touches JAX
        results = run(args, argv)
    except BenchError as e:
        print(f"ssd-bench: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        if "max_seq_len" not in str(e):  # not the context check: a bug, with its traceback
            raise
        # The engine's context check, in the bench's own flags.
        msg = str(e).splitlines()[0].replace("EngineConfig(max_seq_len=...)", "--max-seq-len")
        print(f"ssd-bench: error: {msg.replace('max_new_tokens', '--output-len')}",
              file=sys.stderr)
        return 2
    report(results, args)
    return 0


def _portable(argv: list[str]) -> list[str]:
    """The command as recorded in results: absolute paths inside the working directory become
    relative, and others become their base name, so no machine's folders end up in the repo."""
    import os
    out = []
    for a in argv:
        if os.path.isabs(a):
            rel = os.path.relpath(a)
            a = rel if not rel.startswith("..") else os.path.basename(a.rstrip("/")) or a
        out.append(a)
    return out
