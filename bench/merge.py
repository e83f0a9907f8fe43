"""Several bench runs reported as one: `make bench-real` runs the real pair one suite per
command (each 40-70 min on the 2-core VMs), so that a run cut short loses one suite, not four,
and `make` reruns only the suites without results. Only runs that could have been one run are
merged: the same machine type (CPU model, cores, devices, package versions, XLA flags), the
same settings and sweep points, different suites. Each suite's cells then come from one run
(its modes timed in turn, --interleave); ratios across suites are those of runs apart in time,
and the merged results say so.

    ssd-bench report results/a/bench.json results/b/bench.json --out results/ab [--readme R]
"""
from __future__ import annotations

from bench.results import LABELS, annotate

# The machine as results record it (bench.cli.machine), less what differs between two
# VMs of one type (the kernel build in `platform`) or two runs (the date).
MACHINE = ("cpu_model", "processor", "cpu_count", "usable_cores", "devices", "versions",
           "xla_flags")
# Settings that may differ between the runs: their suites, and the transformers peers' threads
# (recorded only by a run with --peers).
FREE = ("suites", "torch_threads")


class MergeError(ValueError):
    """Runs that cannot be reported as one; the message names the difference."""


def merge(parts: list[tuple[str, dict]]) -> dict:
    """The (name, results) `parts` as one results dict (annotated afresh). Raises MergeError."""
    if len(parts) < 2:
        raise MergeError("give two or more results files to merge")
    name0, first = parts[0]
    for name, r in parts:
        if not r["machine"].get("cpu_model"):
            raise MergeError(f"{name} does not name its CPU model (written by an older "
                             "ssd-bench): rerun that suite to merge it")
    seen: dict[str, str] = {}
    for name, r in parts:
        for key in MACHINE:
            if r["machine"].get(key) != first["machine"].get(key):
                raise MergeError(f"{name} ran on another machine than {name0} ({key}: "
                                 f"{r['machine'].get(key)!r} vs {first['machine'].get(key)!r}): "
                                 "merge only runs of one machine type")
        for key in sorted(set(r["config"]) | set(first["config"])):
            if key not in FREE and r["config"].get(key) != first["config"].get(key):
                raise MergeError(f"{name} ran with other settings than {name0} ({key}: "
                                 f"{r['config'].get(key)!r} vs {first['config'].get(key)!r}): "
                                 "merge only runs of one command that differ in --suite")
        for key in ("base", "points"):
            if r[key] != first[key]:
                raise MergeError(f"{name} ran other {key} than {name0}: merge only runs of one "
                                 "command that differ in --suite")
        for suite in r["config"]["suites"]:
            if suite in seen:
                raise MergeError(f"suite {suite} is in both {seen[suite]} and {name}: merge "
                                 "one run per suite")
            seen[suite] = name
    dates = [r["machine"]["date"] for _, r in parts]
    notes = [f"Merged from {len(parts)} runs of one command on one machine type "
             f"({first['machine']['cpu_model']}), one per suite group: "
             + "; ".join(f"{', '.join(r['config']['suites'])} from {r['machine']['date']}"
                         for _, r in parts)
             + ". A suite's cells come from one run; ratios across suites from runs apart "
               "in time."]
    commits = {r["machine"].get("commit") for _, r in parts}
    if len(commits) > 1:  # the code may differ; the settings and machine do not
        notes.append("The runs were made at different commits: " + "; ".join(
            f"{', '.join(r['config']['suites'])} at {r['machine'].get('commit') or 'unknown'}"
            for _, r in parts) + ".")
    for _, r in parts:
        notes += [n for n in r.get("notes", []) if n not in notes]
    cells = [c for _, r in parts for c in r["cells"]]
    suites = list(seen)
    # Modes that ran on some suites only (the add-on cells: --all-cores, --peers), one note
    # per group of suites, e.g. "ssd_jax AR, all cores; transformers AR ran on code only."
    partial: dict[tuple[str, ...], list[str]] = {}
    for mode in dict.fromkeys(c["mode"] for c in cells):
        where = tuple(s for s in suites
                      if any(c["mode"] == mode and c["suite"] == s for c in cells))
        if list(where) != suites:
            partial.setdefault(where, []).append(LABELS.get(mode, mode))
    notes += [f"{'; '.join(labels)} ran on {', '.join(where)} only."
              for where, labels in partial.items()]
    threads = next((r["config"].get("torch_threads") for _, r in parts
                    if r["config"].get("torch_threads") is not None), None)
    merged = dict(first, command="; ".join(r["command"] for _, r in parts),
                  machine=dict(first["machine"], date=f"{min(dates)} to {max(dates)}"),
                  config=dict(first["config"], suites=suites, torch_threads=threads),
                  cells=cells, calibration=[c for _, r in parts for c in r["calibration"]],
                  notes=notes, plots=[])
    return annotate(merged)
