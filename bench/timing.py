"""Shared pieces of the micro-benchmarks (verify_cost, decode_throughput): a warmed-up median
timer and the markdown table + JSON they print."""
from __future__ import annotations

import json
import statistics
import time
from typing import Callable


def median_ms(step: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `step()` in ms; `step` must block until its result is ready. The
    warm-up calls (compilation, first touch of buffers) are not timed."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def emit(header: list[str], cells: list[list[str]], json_path: str | None, payload: dict,
         caption: str = "") -> None:
    """Print a markdown table (header row, then one row per cell list) and write `payload` to
    `json_path` when given."""
    print("| " + " | ".join(header) + " |" + (f"  ({caption})" if caption else ""))
    print("|" + "---|" * len(header))
    for row in cells:
        print("| " + " | ".join(row) + " |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=1)
