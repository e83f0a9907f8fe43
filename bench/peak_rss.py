"""Peak resident memory of a command and every process it starts, summed over the tree.

    python -m bench.peak_rss -- python -m ssd_jax "Write a haiku."

Samples the process tree every 0.2 s (psutil) and prints the largest sum of RSS seen, with the
per-process split at that moment; the command's own output and exit code pass through.
"""
from __future__ import annotations

import subprocess
import sys
import time


def main(argv=None) -> int:
    import psutil
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m bench.peak_rss -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    proc = subprocess.Popen(argv)
    root = psutil.Process(proc.pid)
    peak, split = 0, {}
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            rss = {}
            for p in tree:
                try:
                    rss[f"{p.pid} {' '.join(p.cmdline()[1:4])[:60]}"] = p.memory_info().rss
                except psutil.Error:
                    pass
            if sum(rss.values()) > peak:
                peak, split = sum(rss.values()), rss
        except psutil.Error:
            pass
        time.sleep(0.2)
    print(f"peak RSS of the process tree: {peak / 2**30:.2f} GiB", file=sys.stderr)
    for name, rss in sorted(split.items(), key=lambda kv: -kv[1]):
        print(f"  {rss / 2**30:6.2f} GiB  {name}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
