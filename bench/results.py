"""Results of a bench run: derived numbers (speedups, equality with AR, the speed model's
prediction), markdown tables, and the README section regenerated from a results JSON.

    ssd-bench report results/bench.json [...] [--out DIR] [--readme README.md]

prints the section (several runs' results merged as one: bench/merge.py), or replaces the
part of README.md between the markers below (appending it when the markers are absent); --out
writes the JSON, plots and results.md. Every number comes from the JSON, i.e. from a run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from bench.speed_model import predict_sd, predict_ssd

BEGIN, END = "<!-- ssd-bench:begin -->", "<!-- ssd-bench:end -->"
MODES = ("ar", "sd", "ssd", "ar-all", "sd-all", "hf-ar", "hf-assisted")
LABELS = {"ar": "ssd_jax AR", "sd": "ssd_jax SD", "ssd": "ssd_jax SSD",
          "ar-all": "ssd_jax AR, all cores", "sd-all": "ssd_jax SD, all cores",
          "hf-ar": "transformers AR", "hf-assisted": "transformers assisted"}
POINT = ("k", "budget", "fanout", "c", "backup", "temperature", "top_p", "batch")


def point_of(cell: dict) -> tuple:
    return tuple(cell.get(f) for f in POINT)


def is_base(cell: dict, base: dict) -> bool:
    """The cell ran at the base configuration (fields its mode ignores are None; fields that
    are None in `base` are free). With k=auto as the base, a speculative cell is base only if
    the engine chose its settings (sweep cells beside it are not)."""
    if base["k"] is None and cell["mode"] in ("sd", "ssd", "sd-all") and not cell.get("automatic"):
        return False
    return all(base[f] is None or cell.get(f) is None or cell.get(f) == base[f] for f in POINT)


def _ar_ref(cells, cell):
    same = [c for c in cells if c["mode"] == "ar" and c["suite"] == cell["suite"]
            and c["temperature"] == cell["temperature"] and c["top_p"] == cell["top_p"]]
    exact = [c for c in same if c["batch"] == cell["batch"]]
    return (exact or same or [None])[0], bool(exact)


def _backup_time(cells, calib, cell, phases) -> float:
    """The neural backup is K draft steps, i.e. SD's drafting: use SD's measured draft time at
    the same K, temperature and batch when there is one; else the select time attributed to
    rounds with a miss (an upper bound: it includes the hit rounds' lookups/exchanges)."""
    if cell["backup"] in ("neural", "auto"):
        for sd in cells:
            if sd["mode"] == "sd" and all(sd[f] == cell[f] for f in ("k", "temperature", "top_p",
                                                                    "batch")):
                ph = sd.get("phases") or calib.get(("sd", point_of(sd)))
                if ph and ph.get("t_draft"):
                    return ph["t_draft"]
    return phases["t_backup_est"]


def _same(out: list[int], ar: list[int], stop_ids: list[int] | None) -> bool:
    """A greedy answer equals AR's; with `stop_ids` (transformers' cells), up to AR's first
    stop token, where the answer ends (what follows it, with EOS ignored, each stack makes
    its own way: bench.peers)."""
    if stop_ids:
        end = next((i for i, t in enumerate(ar) if t in stop_ids), len(ar))
        return out[:end] == ar[:end]
    return out == ar


def annotate(results: dict) -> dict:
    """Adds speedup_vs_ar, matches_ar (greedy) and prediction to every cell, in place."""
    cells = results["cells"]
    calib = {(c["mode"], tuple(c["point"][f] for f in POINT)): c["phases"]
             for c in results.get("calibration", [])}
    for cell in cells:
        ar, same_batch = _ar_ref(cells, cell)
        cell["speedup_vs_ar"] = (cell["decode_tok_s"] / ar["decode_tok_s"]
                                 if ar and same_batch and ar["decode_tok_s"] else None)
        cell["matches_ar"] = None
        if ar is not None and cell["temperature"] == 0 and cell["mode"] != "ar":
            eq = sum(_same(a, b, cell.get("stop_ids")) for a, b in zip(cell["outputs"],
                                                                         ar["outputs"]))
            cell["matches_ar"] = [eq, len(cell["outputs"])]
        cell["prediction"] = None
        phases = cell.get("phases") or calib.get((cell["mode"], point_of(cell)))
        if not phases:
            continue
        rows = cell["num_prompts"] / math.ceil(cell["num_prompts"] / cell["batch"])
        ar_tok_s = ar["decode_tok_s"] if ar and same_batch else None
        if cell["mode"] == "ssd" and cell["ssd"]:
            cell["prediction"] = predict_ssd(
                hist_hit=cell["ssd"]["accept_hist_hit"], hist_miss=cell["ssd"]["accept_hist_miss"],
                all_hit_rate=cell["ssd"]["all_hit_rate"], rows=rows, ar_tok_s=ar_tok_s,
                t_verify=phases["t_verify"], t_build=phases["t_build"],
                t_backup=_backup_time(cells, calib, cell, phases))
        elif cell["mode"] == "sd" and cell["accept_hist"]:
            cell["prediction"] = predict_sd(hist=cell["accept_hist"], rows=rows,
                                            t_verify=phases["t_verify"],
                                            t_draft=phases["t_draft"], ar_tok_s=ar_tok_s)
    return results


# ------------------------------------------------------------------ tables
def _f(x, fmt="{:.1f}"):
    return "–" if x is None else fmt.format(x)


def summary_table(results: dict) -> str:
    """Base configuration: decode tok/s per suite and mode, plus SSD's ratios."""
    base = results["base"]
    cells = [c for c in results["cells"] if is_base(c, base)]
    modes = [m for m in MODES if any(c["mode"] == m for c in cells)]
    suites = list(dict.fromkeys(c["suite"] for c in cells))
    cols = [LABELS[m] for m in modes]
    extra = ["SSD/AR", "SSD/SD", "SSD/AR predicted"] if "ssd" in modes else []
    lines = ["| suite | " + " | ".join(cols + extra) + " |",
             "|---|" + "---|" * (len(cols) + len(extra))]
    for suite in suites + (["all"] if len(suites) > 1 else []):
        rate = {}
        for m in modes:
            sel = [c for c in cells if c["mode"] == m and suite in (c["suite"], "all")]
            s = sum(c["decode_s"] for c in sel)
            # a mode timed on some suites only (--extras-suite) has no all-suites rate
            whole = suite != "all" or {c["suite"] for c in sel} == set(suites)
            rate[m] = sum(c["decode_tokens"] for c in sel) / s if s and whole else None
        row = [_f(rate[m]) for m in modes]
        if extra:
            ratio = lambda a, b: rate[a] / rate[b] if rate.get(a) and rate.get(b) else None
            pred = [c["prediction"]["speedup_vs_ar"] for c in cells if c["mode"] == "ssd"
                    and c["suite"] == suite and c.get("prediction")]
            row += [_f(ratio("ssd", "ar"), "{:.2f}x"), _f(ratio("ssd", "sd"), "{:.2f}x"),
                    _f(pred[0] if pred else None, "{:.2f}x")]
        lines.append(f"| {suite} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def detail_table(results: dict) -> str:
    """Every cell. "tok/s predicted" is the start-up model's (autotune.predict, what an
    automatic choice is made with; for given settings and AR, the same model at them), made
    before the cell was timed; "predicted vs AR" the phase model's from the cell's own
    measured phases."""
    head = ("| suite | mode | K | M | C | T | B | tok/s | tok/s predicted | TTFT ms | TPOT ms | "
            "tok/round | accept | hit rate | vs AR | predicted vs AR | = AR |")
    lines = [head, "|" + "---|" * 17]
    for c in results["cells"]:
        ssd, pred, eq = c.get("ssd"), c.get("prediction"), c.get("matches_ar")
        start = c.get("predicted_tok_s", (c.get("settings") or {}).get("predicted_tok_s"))
        lines.append("| " + " | ".join([
            c["suite"], LABELS.get(c["mode"], c["mode"]), _f(c["k"], "{}"),
            _f(c["budget"] or (2 * (c["k"] + 1) if c["budget"] is not None else None), "{}"),
            _f(c["c"] if c["mode"] == "ssd" else None, "{:g}"),
            _f(c["temperature"], "{:g}"), str(c["batch"]), _f(c["decode_tok_s"]),
            _f(start), _f(c["ttft_ms"], "{:.0f}"), _f(c["tpot_ms"]),
            _f(c["tokens_per_round"], "{:.2f}"),
            _f(c["acceptance"], "{:.2f}"), _f(ssd and ssd["hit_rate"], "{:.2f}"),
            _f(c.get("speedup_vs_ar"), "{:.2f}x"),
            _f(pred and pred.get("speedup_vs_ar"), "{:.2f}x"),
            "–" if eq is None else f"{eq[0]}/{eq[1]}"]) + " |")
    return "\n".join(lines)


def phase_table(results: dict) -> str:
    """Per-round phase times of the speculative cells (what the speed model is built from):
    SD drafts then verifies; SSD builds its cache while the target verifies, and only the
    target's wait for the next speculation (select/backup + exchange) is exposed."""
    rows = [c for c in results["cells"] if c.get("phases") and c["mode"] in ("sd", "ssd")]
    if not rows:
        return ""
    lines = ["| suite | mode | rounds | verify ms | draft ms (SD) | cache build ms (SSD, overlapped) "
             "| exposed draft ms | exposed / verify |", "|" + "---|" * 8]
    for c in rows:
        p = c["phases"]
        exposed = p.get("t_draft") if c["mode"] == "sd" else p.get("t_exposed")
        lines.append("| " + " | ".join([
            c["suite"], LABELS.get(c["mode"], c["mode"]), str(p["rounds"]),
            _f(1e3 * p["t_verify"]), _f(p.get("t_draft") and 1e3 * p["t_draft"]),
            _f(p.get("t_build") and 1e3 * p["t_build"]), _f(exposed and 1e3 * exposed),
            _f(exposed and exposed / p["t_verify"], "{:.0%}")]) + " |")
    return "\n".join(lines)


def machine_line(results: dict) -> str:
    m, cfg = results["machine"], results["config"]
    vers = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    split = cfg["device_split"]
    split = f"target {split[0]} / draft {split[1]} devices" if split else "default placement"
    cpu = m.get("cpu_model") or m["processor"]  # results before session 50 lack the model
    return (f"{m['platform']} ({cpu}), {m['cpu_count']} CPU cores "
            f"({m['usable_cores']} usable), JAX devices: {m['devices']}; driver "
            f"{cfg['driver']}, {split}; {vers}; XLA_FLAGS {m.get('xla_flags') or '(none)'}; "
            f"{m['date']}.")


def section(results: dict, plot_dir: str | None = None) -> str:
    cfg, base = results["config"], results["base"]
    models = f"target `{cfg['target']}`" + (f", draft `{cfg['draft']}`" if cfg["draft"] else "")
    spec = ""
    if any(c["mode"] in ("sd", "ssd", "hf-assisted") for c in results["cells"]):
        if base["k"] is None:
            c = ("Saguaro's C chosen with them at T > 0" if base["c"] is None
                 else f"C={base['c']:g}")
            spec = (f"; K, M and backup chosen by the engine's speed model per mode (cells); "
                    f"{base['fanout']} fan-out, {c}")
        else:
            mb = base["budget"] or 2 * (base["k"] + 1)
            spec = (f"; K={base['k']}, M={mb} ({base['fanout']} fan-out, {base['backup']} "
                    f"backup, C={1.0 if base['c'] is None else base['c']:g})")
    out = [BEGIN, "## Benchmark results", "",
           f"Machine: {machine_line(results)}", "",
           f"Models: {models}. Protocol: suites {', '.join(cfg['suites'])} × "
           f"{cfg['num_prompts']} prompts, batch {base['batch']}, temperature "
           f"{base['temperature']:g}, {cfg['output_len']} new tokens, decode tok/s with prefill "
           f"excluded{spec}. Compilation is done before timing.", "",
           f"Command: `{results['command']}`", "", summary_table(results), ""]
    for note in results.get("notes", []):
        out += [f"- {note}"]
    phases = phase_table(results)
    if phases:
        out += ["", "Per-round phases (means):", "", phases]
    out += ["", "<details><summary>All cells</summary>", "", detail_table(results), "",
            "</details>", ""]
    for png in results.get("plots", []):
        path = png if plot_dir is None else os.path.join(plot_dir, Path(png).name)
        out.append(f"![{Path(png).stem}]({path})")
    out.append(END)
    return "\n".join(out) + "\n"


def save_dir(results: dict, out: Path) -> None:
    """bench.json, the plots and results.md in `out`; the JSON first, so that nothing that may
    fail on it (the plots) loses the measurements."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    from bench.plots import make_plots
    results["plots"] = make_plots(results, out)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(section(results, "."))


def update_readme(readme: Path, text: str) -> None:
    old = readme.read_text() if readme.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        new = old + ("\n" if old and not old.endswith("\n") else "") + text
    readme.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ssd-bench report", description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+",
                    help="a results JSON written by ssd-bench --json / --out; several: runs of "
                         "one command on different suites, reported as one (bench/merge.py)")
    ap.add_argument("--out", default=None,
                    help="write bench.json, the plots and results.md here")
    ap.add_argument("--readme", default=None, help="replace this file's results section")
    args = ap.parse_args(argv)
    parts = []
    for name in args.json:
        path = Path(name)
        if not path.exists():
            print(f"ssd-bench report: error: {path} does not exist: run ssd-bench with --json "
                  "or --out first", file=sys.stderr)
            return 2
        try:
            results = json.loads(path.read_text())
            if not (isinstance(results, dict) and {"config", "cells"} <= set(results)):
                raise ValueError("no 'config' and 'cells'")
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            print(f"ssd-bench report: error: {path} is not ssd-bench results ({str(e)[:80]}): "
                  "give the bench.json that ssd-bench --json / --out wrote", file=sys.stderr)
            return 2
        parts.append((str(path), results))
    results, home = parts[0][1], Path(args.json[0]).parent
    if len(parts) > 1:
        from bench.merge import MergeError, merge
        try:
            results = merge(parts)
        except MergeError as e:
            print(f"ssd-bench report: error: {e}", file=sys.stderr)
            return 2
    if args.out:
        save_dir(results, Path(args.out))
        home = Path(args.out)
    elif len(parts) > 1 and args.readme:
        print("ssd-bench report: error: merged results need --out for their plots and JSON",
              file=sys.stderr)
        return 2
    if args.readme:
        readme = Path(args.readme)
        plot_dir = os.path.relpath(home.resolve(), readme.resolve().parent)
        update_readme(readme, section(results, plot_dir))
        print(f"updated {readme}")
    else:
        print(section(results))
    return 0
