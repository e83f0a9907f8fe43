#!/usr/bin/env bash
# The accelerator check in one shot, offline, from the working tree (no model files: random
# weights are built on the machine). Every part is time-boxed; a part that runs out keeps what it
# measured and the next part still runs. At most ~7.5 minutes on one GPU (boxes sum to 435 s):
#   tests      the tree-attention kernel tests, compiled (SSD_PALLAS_INTERPRET=0)      90 s
#   kernels    kernel vs XLA reference timings (bench/kernels.py sweep, bf16)         60 s
#   exactness  greedy AR == SD == SSD (batch 1, 4); Pallas model vs XLA model         120 s
#   physics    step costs of real-shaped bf16 models (bench/step_costs.py)           140 s
#   predict    the speed model on those costs + CPU-measured acceptance               15 s
#   summary    part statuses into summary.json                                        10 s
# Usage: bash bench/gpu_check.sh [--dry-run] OUTDIR
#   --dry-run: the same parts on CPU with tiny sizes and the kernel interpreted (CI runs this).
#   PYTHON=... picks the interpreter (default python3); WHEELS=DIR holds wheels for a missing
#   pure-Python dependency (default ./.whl). The H200 image lacked beartype on 2026-12-04:
#   `pip download --no-deps -d .whl beartype==0.23.1` here, and carry .whl.
# Writes exactly OUTDIR/{log.txt, tests.txt, kernels.md, exactness.md, physics.md,
# predictions.md, summary.json, status.txt}; exit status 0 iff every part passed.
set -uo pipefail
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
OUT=${1:?usage: bash bench/gpu_check.sh [--dry-run] OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.whl}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
FILES=(log.txt tests.txt kernels.md exactness.md physics.md predictions.md summary.json status.txt)
for f in "${FILES[@]}"; do rm -f "$OUT/$f"; done
cd "$ROOT"
# No network on the GPU machine: import the project in place rather than pip-installing it.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ ${#DRY[@]} -gt 0 ]; then
  export JAX_PLATFORMS=cpu SSD_PALLAS_INTERPRET=1
  # Two interpreted kernel cases (one split-KV) and the CPU selection rules: the wiring, not
  # the kernel's coverage (the default test run checks every case interpreted).
  TESTS=(-k "gpu_lowering and (decode-B3 or split3) or select_attention_cpu")
else
  export SSD_PALLAS_INTERPRET=0
  TESTS=()
fi

LOG="$OUT/log.txt"
for mod in jaxtyping beartype pytest jinja2; do
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    echo "installing $mod's wheel from ${WHEELS#"$ROOT"/} (offline)" | tee -a "$LOG"
    SITE=$(mktemp -d)  # a scratch site for the wheels, outside the repository
    "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --target "$SITE" \
      "$WHEELS"/*.whl >>"$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:$SITE" \
      || echo "WARNING: $mod missing and not installable from ${WHEELS#"$ROOT"/}" | tee -a "$LOG"
    break
  fi
done
{
  echo "date $(date -u +%FT%TZ)  commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 \
    || echo "no nvidia-smi"
  "$PY" -c "import sys, jax, jaxlib, flax; print('python', sys.version.split()[0], 'jax', \
jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'backend', \
jax.default_backend()); print('devices', jax.devices())"
} 2>&1 | tee -a "$LOG"

part() {  # part NAME SECONDS LOGFILE CMD...: run CMD time-boxed, one status line per part
  local name=$1 limit=$2 log=$3 t0=$SECONDS
  shift 3
  echo "=== $name (time box ${limit}s)" | tee -a "$log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "$name stopped by its ${limit}s time box" \
    | tee -a "$log"
  echo "$name rc=$rc seconds=$((SECONDS - t0))" >>"$OUT/status.txt"
}

CHECK=("$PY" bench/gpu_check.py)
part tests 90 "$OUT/tests.txt" "$PY" -m pytest tests/test_tree_attention.py -q -rs \
  -p no:cacheprovider "${TESTS[@]}"
part kernels 60 "$LOG" "${CHECK[@]}" kernels --out "$OUT" "${DRY[@]}"
part exactness 120 "$LOG" "${CHECK[@]}" exactness --out "$OUT" "${DRY[@]}"
# PHYSICS_S shortens the physics box for a rerun on a lease's last minutes (its timings stop at
# the box less 40 s, leaving time to write the table).
PHYSICS_S=${PHYSICS_S:-140}
part physics "$PHYSICS_S" "$LOG" "${CHECK[@]}" physics --out "$OUT" --budget-s $((PHYSICS_S - 40)) \
  "${DRY[@]}"
part predict 15 "$LOG" "${CHECK[@]}" predict --out "$OUT" "${DRY[@]}"
timeout 10 "${CHECK[@]}" summary --out "$OUT" 2>&1 | tee -a "$LOG"
# The tables again at the end, so a caller that sees only the output's tail still gets them.
for f in exactness.md physics.md predictions.md status.txt; do
  echo "--- $f"; cat "$OUT/$f" 2>/dev/null || echo "(missing)"
done
! grep -qv " rc=0 " "$OUT/status.txt"
