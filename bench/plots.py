"""PNG plots of a bench run (matplotlib, Agg). Each plot is drawn only when the run measured
what it needs: a sweep plot needs at least two values of the swept parameter."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.results import LABELS, MODES, is_base

SWEPT = {"k": "K (lookahead)", "budget": "budget M (branches per row)",
         "temperature": "temperature", "batch": "batch size"}


def _rate(cells) -> float | None:
    s = sum(c["decode_s"] for c in cells)
    return sum(c["decode_tokens"] for c in cells) / s if s else None


def _along(results, field, mode):
    """Cells of `mode` that differ from the base configuration only in `field`, grouped by its
    value (all suites pooled)."""
    base = results["base"]
    others = {**base, field: None}
    out = {}
    for c in results["cells"]:
        if c["mode"] == mode and c.get(field) is not None and is_base(c, others):
            v = c[field] or (2 * (c["k"] + 1) if field == "budget" else c[field])  # 0: default M
            out.setdefault(v, []).append(c)
    return dict(sorted(out.items()))


def _speedups(results, field, mode):
    ar = _along(results, field, "ar") if field in ("temperature", "batch") else None
    base_ar = [c for c in results["cells"] if c["mode"] == "ar" and is_base(c, results["base"])]
    xs, ys = [], []
    for v, cells in _along(results, field, mode).items():
        ref = _rate(ar.get(v, [])) if ar is not None else _rate(base_ar)
        if ref:
            xs.append(v)
            ys.append(_rate(cells) / ref)
    return xs, ys


def _sum(hists) -> np.ndarray:
    """Accept-length histograms of cells with different K, summed (shorter ones zero-padded)."""
    width = max(len(h) for h in hists)
    return sum(np.pad(np.asarray(h), (0, width - len(h))) for h in hists)


def make_plots(results: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    base_cells = [c for c in results["cells"] if is_base(c, results["base"])]
    suites = list(dict.fromkeys(c["suite"] for c in base_cells))
    modes = [m for m in MODES if any(c["mode"] == m for c in base_cells)]
    if base_cells:  # tok/s per mode per suite
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(suites) * max(1, len(modes)) / 3, 3.6))
        w = 0.8 / len(modes)
        for i, m in enumerate(modes):
            ys = [_rate([c for c in base_cells if c["mode"] == m and c["suite"] == s]) or 0
                  for s in suites]
            ax.bar(np.arange(len(suites)) + i * w, ys, w, label=LABELS[m])
        ax.set_xticks(np.arange(len(suites)) + w * (len(modes) - 1) / 2, suites)
        ax.set_ylabel("decode tok/s")
        ax.set_title("Decode throughput (prefill excluded)")
        ax.legend(fontsize=8)
        save(fig, "tok_s_by_suite.png")

    spec = [c for c in base_cells if c["mode"] in ("sd", "ssd") and c.get("accept_hist")]
    if spec:  # accept-length histogram, SSD split into hits and misses
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        bars = []
        for m in ("sd", "ssd"):
            cs = [c for c in spec if c["mode"] == m]
            if not cs:
                continue
            if m == "ssd" and all(c.get("ssd") for c in cs):
                bars.append(("SSD after hit", _sum([c["ssd"]["accept_hist_hit"] for c in cs])))
                bars.append(("SSD after miss", _sum([c["ssd"]["accept_hist_miss"] for c in cs])))
            else:
                bars.append((LABELS[m], _sum([c["accept_hist"] for c in cs])))
        width = max(len(h) for _, h in bars)  # cells may differ in K (k=auto chooses per cell)
        bars = [(lab, np.pad(h, (0, width - len(h)))) for lab, h in bars]
        total = {lab: h.sum() for lab, h in bars}
        w = 0.8 / len(bars)
        for i, (lab, h) in enumerate(bars):
            ax.bar(np.arange(len(h)) + i * w, h / max(total[lab], 1), w, label=lab)
        ax.set_xlabel("accepted draft tokens k per round")
        ax.set_ylabel("fraction of rounds")
        ax.set_xticks(np.arange(len(bars[0][1])) + w * (len(bars) - 1) / 2,
                      range(len(bars[0][1])))
        ax.legend(fontsize=8)
        ax.set_title("Accept-length histogram")
        save(fig, "accept_hist.png")

    temps = _along(results, "temperature", "ssd")
    if len(temps) >= 2:  # hit rate and tok/s vs temperature
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        a1.plot(list(temps), [np.mean([c["ssd"]["hit_rate"] for c in cs]) for cs in temps.values()],
                "o-", label="hit rate (per row)")
        a1.plot(list(temps), [np.mean([c["ssd"]["all_hit_rate"] for c in cs])
                              for cs in temps.values()], "s--", label="all-hit rate (batch)")
        a1.set_xlabel("temperature")
        a1.set_ylim(0, 1.02)
        a1.legend(fontsize=8)
        a1.set_title("SSD cache hit rate")
        for m in modes:
            pts = _along(results, "temperature", m)
            if len(pts) >= 2:
                a2.plot(list(pts), [_rate(cs) for cs in pts.values()], "o-", label=LABELS[m])
        a2.set_xlabel("temperature")
        a2.set_ylabel("decode tok/s")
        a2.legend(fontsize=8)
        save(fig, "temperature.png")

    for field in ("k", "budget", "batch"):
        series = {m: _speedups(results, field, m) for m in ("sd", "ssd")}
        if not any(len(xs) >= 2 for xs, _ in series.values()):
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for m, (xs, ys) in series.items():
            if len(xs) >= 2:
                ax.plot(xs, ys, "o-", label=LABELS[m])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel(SWEPT[field])
        ax.set_ylabel("speedup over ssd_jax AR")
        ax.legend(fontsize=8)
        save(fig, f"speedup_vs_{field}.png")

    pred = [c for c in results["cells"] if c["mode"] == "ssd" and c.get("prediction")
            and c["prediction"].get("speedup_vs_ar") and c.get("speedup_vs_ar")]
    if pred:  # measured vs speed-model prediction
        fig, ax = plt.subplots(figsize=(4.6, 4.2))
        xs = [c["prediction"]["speedup_vs_ar"] for c in pred]
        ys = [c["speedup_vs_ar"] for c in pred]
        base = results["base"]
        for i, (c, x, y) in enumerate(zip(pred, xs, ys)):
            ax.scatter(x, y)
            label = " ".join([c["suite"]] + [f"{f}={c[f]:g}" for f in SWEPT
                                             if c[f] != base[f]])
            ax.annotate(label, (x, y), xytext=(4, 4 + 7 * (i % 3)), textcoords="offset points",
                        fontsize=6)
        hi = max(xs + ys + [1.0]) * 1.1
        ax.plot([0, hi], [0, hi], color="gray", lw=0.8, label="measured = predicted")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel("predicted SSD speedup over AR (Theorem 7)")
        ax.set_ylabel("measured SSD speedup over AR")
        ax.legend(fontsize=8)
        save(fig, "ssd_vs_speed_model.png")
    return made
