"""`ssd-bench plan`: mesh layout, per-device memory and predicted AR / SD / SSD throughput.

    ssd-bench plan --target llama-3.1-70b --draft llama-3.2-1b --device h100-80gb \
        --target-devices 4 --draft-devices 1 --batch 1 --context 4096 --k 7

Models are catalogue names (ssd_jax.plan.HF_CONFIGS) or paths to a config.json / HF directory.
Exit status 2 when a mesh does not fit, with the overflow and the fix on stderr.
"""
from __future__ import annotations

import argparse
import sys

from ssd_jax.plan import (DEVICES, HF_CONFIGS, Assumptions, LayoutError, Setup, check_fits,
                          get_device, predict, resolve)
from ssd_jax.plan.devices import GB
from ssd_jax.plan.layout import MeshMemory, draft_memory, sd_memory, target_memory
from ssd_jax.sharding import logical_sizes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ssd-bench plan", description=__doc__.split("\n")[0])
    models = ", ".join(HF_CONFIGS)
    p.add_argument("--target", required=True, help=f"{models}, or a config.json path")
    p.add_argument("--draft", required=True, help="same choices as --target")
    p.add_argument("--device", default="h100-80gb", help=", ".join(DEVICES))
    p.add_argument("--target-devices", type=int, default=1, help="target mesh size (its TP)")
    p.add_argument("--draft-devices", type=int, default=1, help="draft mesh size (its TP)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096, help="tokens per row in the KV cache")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--k", type=int, default=7, help="SSD lookahead K")
    p.add_argument("--sd-k", type=int, default=None, help="SD lookahead (default: --k)")
    p.add_argument("--fanout-budget", type=int, default=None,
                   help="SSD branches per row M (default 3*(K+1), the paper's F=3)")
    p.add_argument("--acceptance", type=float, default=0.8, help="per-token acceptance a")
    p.add_argument("--hit-rate", type=float, default=0.88, help="per-row cache hit rate p")
    p.add_argument("--sampling", action="store_true",
                   help="temperature > 0: keep q' [B,M,K,V] fp32 in the speculation cache")
    p.add_argument("--mem-fraction", type=float, default=0.95,
                   help="usable share of device memory (on GPU set XLA_PYTHON_CLIENT_MEM_FRACTION "
                        "to match: JAX preallocates 75%% by default)")
    p.add_argument("--efficiency", type=float, default=1.0,
                   help="attained fraction of peak bandwidth and FLOP/s (1 = pure roofline)")
    p.add_argument("--overhead-us", type=float, default=0.0, help="fixed cost per forward")
    p.add_argument("--collective-us", type=float, default=None,
                   help="small-collective latency (default: the device table's)")
    p.add_argument("--devices-per-host", type=int, default=None,
                   help="accelerators per host (a pod or cluster): prints which host holds "
                        "what and each host's launch command")
    p.add_argument("--coordinator", default="HOST0:8476",
                   help="host:port of process 0 in the printed launch commands")
    return p


def hosts(s: Setup, per_host: int, coordinator: str) -> list[str]:
    """Which host holds what, by the engine's own split (sharding.plan_split gives the draft
    whole hosts), and the launch command of each host. Raises LayoutError for a split that
    puts both groups on one host (each process belongs to one group)."""
    from types import SimpleNamespace
    from ssd_jax.sharding import plan_split
    n = s.target_devices + s.draft_devices
    n_hosts = -(-n // per_host)
    devices = [SimpleNamespace(process_index=h, id=h * per_host + i)
               for h in range(n_hosts) for i in range(per_host)]
    target, draft = plan_split(devices, s.target_devices, s.draft_devices)
    held = {h: [] for h in range(n_hosts)}
    for side, group in (("target", target), ("draft", draft)):
        for shard, d in enumerate(group):
            held[d.process_index].append((side, shard))
    both = [h for h, x in held.items() if len({side for side, _ in x}) > 1]
    if both:
        raise LayoutError(
            f"host {both[0]} would hold devices of both the target and the draft: with "
            f"{per_host} devices per host give the draft a multiple of {per_host} devices "
            f"(whole hosts), or run one process per device")
    env = (f"SSD_JAX_COORDINATOR={coordinator} SSD_JAX_NUM_PROCESSES={n_hosts} "
           "SSD_JAX_PROCESS_ID={i}")
    cmd = (f"python -m ssd_jax --model {s.target_name} --draft {s.draft_name} --mode ssd "
           f"--k {s.k} --mesh {s.target_devices},{s.draft_devices} \"a prompt\"")
    lines = ["", f"hosts ({n_hosts} x {per_host} devices; every host runs the same command, "
             "its process id set; Slurm, Open MPI and Cloud TPU set these themselves)"]
    for h, x in held.items():
        if not x:
            what = "nothing (idle: it joins the job and waits)"
        else:
            side = x[0][0]
            shards = [i for _, i in x]
            what = (f"{side} shards {shards[0]}-{shards[-1]} of TP-{len(target if side == 'target' else draft)}"
                    + (" (lead: requests and results)" if h == target[0].process_index else ""))
        lines.append(f"  host {h}: {what}")
    lines += ["", "launch (each host):", "  " + env.replace("{i}", "<host index>") + " \\",
              "    " + cmd]
    return lines


def _split(config, tp: int) -> str:
    if tp == 1:
        return "TP=1, replicated"
    parts = [f"{axis} {n}->{n // tp}" if n % tp == 0 else f"{axis} {n} replicated"
             for axis, n in logical_sizes(config).items()]
    return f"TP={tp}: " + ", ".join(parts) + " per device"


def _devices(r: range) -> str:
    return f"device  {r.start}" if len(r) == 1 else f"devices {r.start}-{r.stop - 1}"


def _row(label: str, m: MeshMemory, usable: float) -> str:
    vals = (m.weights, m.kv_cache, m.spec, m.total, usable, usable - m.total)
    return f"  {label:<24}" + "".join(f"{v / GB:>10.2f}" for v in vals)


def report(s: Setup, a: Assumptions) -> str:
    t, d, sd = target_memory(s), draft_memory(s), sd_memory(s)
    n = s.target_devices + s.draft_devices
    lines = [
        f"plan: {s.target_name} target + {s.draft_name} draft on {n} x {s.device.name} "
        f"({s.target.dtype})",
        f"batch {s.batch}, context {s.context} (+{s.cache_len - s.context} slack slots), "
        f"SSD K={s.k} M={s.budget}, SD K={s.sd_k}, {'sampling' if s.sampling else 'greedy'}",
        "", "mesh layout",
        f"  {_devices(t.devices):<12} target  {s.target_name}  {_split(s.target, t.tp)}",
        f"  {_devices(d.devices):<12} draft   {s.draft_name}  {_split(s.draft, d.tp)}",
        "", "per-device memory (GB)       weights  KV cache  spec/tree     total    usable      free",
        _row(f"target ({_devices(t.devices)})", t, s.usable),
        _row(f"draft  ({_devices(d.devices)})", d, s.usable),
        _row("SD baseline (target)", sd, s.usable)
        + ("" if sd.total <= s.usable else "  DOES NOT FIT: SD prediction is moot"),
        "  (AR uses the target row; SD replicates the draft on every target device; the draft's "
        "spec/tree = SpecCache + glue/tree K/V)",
    ]
    preds, ph = predict(s, a)
    ar = preds[0].tok_s
    lines += ["", f"predicted decode throughput (roofline x {a.efficiency:g}; acceptance "
              f"a={a.acceptance:g}, hit rate p={a.hit_rate:g}/row, all-hit p^B="
              f"{ph['all_hit']:.2f}, neural backup)",
              "  mode   K   tokens/round   ms/round     tok/s   vs AR"]
    for pr in preds:
        lines.append(f"  {pr.mode:<4} {pr.k or '-':>3} {pr.tokens_per_round:>14.2f} "
                     f"{pr.round_s * 1e3:>10.2f} {pr.tok_s:>9.1f} {pr.tok_s / ar:>6.2f}x")
    ms = {k: v * 1e3 for k, v in ph.items()}
    lines.append(
        f"  phases (ms): AR step {ms['ar_step']:.2f} | SD draft step {ms['sd_draft_step']:.2f}, "
        f"verify {ms['sd_verify']:.2f} | SSD verify {ms['verify']:.2f}, tree build "
        f"{ms['tree']:.2f} (T_p={ph['tree'] / ph['verify']:.2f}), backup {ms['backup']:.2f} "
        f"(T_b={ph['backup'] / ph['verify']:.2f}), exchange {ms['exchange']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        target_name, target = resolve(args.target, dtype=args.dtype)
        draft_name, draft = resolve(args.draft, dtype=args.dtype)
        s = Setup(target_name=target_name, target=target, draft_name=draft_name, draft=draft,
                  device=get_device(args.device), target_devices=args.target_devices,
                  draft_devices=args.draft_devices, batch=args.batch, context=args.context,
                  k=args.k, sd_k=args.sd_k or args.k,
                  budget=args.fanout_budget or 3 * (args.k + 1), sampling=args.sampling,
                  mem_fraction=args.mem_fraction)
        a = Assumptions(acceptance=args.acceptance, hit_rate=args.hit_rate,
                        efficiency=args.efficiency, overhead_s=args.overhead_us * 1e-6,
                        collective_s=None if args.collective_us is None
                        else args.collective_us * 1e-6)
        check_fits(s)
    except LayoutError as e:
        print(f"plan refused: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lines = [report(s, a)]
    if args.devices_per_host:
        try:
            lines += hosts(s, args.devices_per_host, args.coordinator)
        except LayoutError as e:
            print(f"plan refused: {e}", file=sys.stderr)
            return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
