#!/usr/bin/env bash
# One-shot GPU check of the tree-attention kernel, offline, from the working tree:
#   1. the kernel tests compiled for the GPU (SSD_PALLAS_INTERPRET=0: same cases, no interpreter),
#   2. the kernel-vs-XLA timing table (bench/kernels.py).
# Usage: bench/gpu_check.sh OUTDIR      (PYTHON=... to pick the interpreter; WHEELS=DIR holds
# wheels for any missing pure-Python dependency, e.g. jaxtyping, default ./.whl)
# Writes OUTDIR/{env.txt, tests.txt, tests.xml, kernels.md, kernels.json, bench.txt, status.txt}.
set -uo pipefail
OUT=${1:?usage: bench/gpu_check.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.whl}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
# No network on the GPU machine: import the project in place rather than pip-installing it.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1

for mod in jaxtyping pytest; do
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    echo "installing $mod from $WHEELS (offline)"
    "$PY" -m pip install --no-index --find-links "$WHEELS" "$mod" >>"$OUT/env.txt" 2>&1 \
      || echo "WARNING: $mod missing and not installable from $WHEELS" | tee -a "$OUT/env.txt"
  fi
done
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/env.txt"
import jax, jaxlib
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "backend", jax.default_backend())
print("devices", jax.devices())
PY

# Budgets keep the whole check to a few minutes; a cut-short bench still leaves its rows.
SSD_PALLAS_INTERPRET=0 timeout 300 "$PY" -m pytest tests/test_tree_attention.py -q -rs \
  -p no:cacheprovider --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.txt"
rc_tests=${PIPESTATUS[0]}

timeout 420 "$PY" bench/kernels.py --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/bench.txt"
rc_bench=${PIPESTATUS[0]}

echo "tests rc=$rc_tests bench rc=$rc_bench" | tee "$OUT/status.txt"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
