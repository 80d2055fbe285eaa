#!/usr/bin/env bash
# The GPU check: on a CUDA machine, in under 8 minutes,
#   1. installs kvbench (editable, no dependency downloads; missing dependencies come from
#      wheels/ when present, see make_wheels.sh),
#   2. checks every Triton kernel against the torch reference on CUDA,
#   3. runs the decode-attention micro-benchmarks (paged vs contiguous, JSON),
#   4. runs `kvbench run --device cuda` paged vs contiguous on Llama-3-8B shapes with random
#      weights and the Triton attention,
#   5. checks the simulator's activation memory model against torch.cuda.max_memory_allocated
#      of the same batch shapes (kvbench.tools.activation_check),
# writing everything under $OUT (default ./gpu-results): check.log (all output),
# summary.md (steps, benchmark table, run table, memory check), bench.json,
# kernels-cuda.xml (JUnit), activation-check.md and run/ (the run's records). It installs into the Python environment of $PYTHON (default
# python3). Exit status: 0 when every step passed, 1 when one failed, 3 without CUDA.
#
# Usage: benchmarks/gpu/check.sh [--dry-run]   (--dry-run prints the steps, runs none)
set -u -o pipefail

cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

RUN_ARGS=(
  --device cuda --model llama-3-8b --engines paged,contiguous --attention triton
  --workload mixed-text --num-requests 48 --kv-memory 8GiB --max-model-len 4096
  --out "$OUT/run"
)
STEPS=(install kernels bench run memory)
# Seconds per step; together under the 8-minute budget with room for start-up.
declare -A LIMIT=([install]=45 [kernels]=150 [bench]=80 [run]=160 [memory]=30)

if [[ $DRY_RUN == 1 ]]; then
  echo "GPU check plan (writes under $OUT, Python: $PY):"
  echo "  install: pip install --no-index --find-links wheels <kvbench's dependencies>" \
    "(only with wheels/); pip install --no-deps --no-build-isolation -e ."
  echo "  kernels: pytest tests/test_kernels_triton.py [-n 8 with pytest-xdist]" \
    "-k 'not test_interpreter' --junitxml $OUT/kernels-cuda.xml"
  echo "  bench:   pytest benchmarks/test_bench_attention_gpu.py --benchmark-json $OUT/bench.json"
  echo "  run:     $PY -m kvbench.cli.app run ${RUN_ARGS[*]}"
  echo "  memory:  $PY -m kvbench.tools.activation_check --device cuda --dtype bfloat16" \
    "> $OUT/activation-check.md"
  for s in "${STEPS[@]}"; do printf '  limit %-8s %4ss\n' "$s" "${LIMIT[$s]}"; done
  exit 0
fi

if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "error: no CUDA device visible to torch under $PY: this check needs a GPU" \
    "(--dry-run prints its steps)" >&2
  exit 3
fi

mkdir -p "$OUT"
LOG=$OUT/check.log
SUMMARY=$OUT/summary.md
: >"$LOG"
FAILED=0
STATUS_ROWS=""

run_step() {  # run_step NAME CMD...: run with the step's time limit, log, record the outcome
  local name=$1 start rc
  shift
  echo "== $name: $*" | tee -a "$LOG"
  start=$(date +%s)
  timeout "${LIMIT[$name]}" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local status=ok
  if [[ $rc == 124 ]]; then status="timed out after ${LIMIT[$name]}s"; elif [[ $rc != 0 ]]; then status="failed (exit $rc)"; fi
  [[ $status == ok ]] || FAILED=1
  STATUS_ROWS+="| $name | $status | $(($(date +%s) - start)) |"$'\n'
  return "$rc"
}

install_kvbench() {
  if [[ -d wheels ]]; then
    # kvbench's own dependency list; pip keeps what is installed and takes the rest from
    # wheels/ (setuptools too, which the editable build below uses).
    local req
    req=$(mktemp)
    "$PY" -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      >"$req" || return
    echo "setuptools>=68" >>"$req"
    "$PY" -m pip install --no-index --find-links wheels -r "$req" || return
  fi
  "$PY" -m pip install --no-deps --no-build-isolation -e . || return
  "$PY" -c "import kvbench.cli.app, kvbench.kernels.triton_attention" || {
    echo "kvbench or one of its dependencies does not import: build wheels/ with" \
      "benchmarks/gpu/make_wheels.sh where pip can download, and bring it here" >&2
    return 1
  }
}

# timeout runs programs, not shell functions: the install runs in a child bash.
export -f install_kvbench
export PY
run_step install bash -c install_kvbench
if [[ $FAILED == 0 ]]; then
  # pytest-xdist, where installed, spreads the Triton compiles over processes.
  XDIST=()
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
  run_step kernels "$PY" -m pytest tests/test_kernels_triton.py -q -p no:cacheprovider \
    "${XDIST[@]}" -k "not test_interpreter" --junitxml "$OUT/kernels-cuda.xml"
  run_step bench "$PY" -m pytest benchmarks/test_bench_attention_gpu.py -q -p no:cacheprovider \
    --benchmark-json "$OUT/bench.json" --benchmark-columns median,iqr,rounds
  run_step run "$PY" -m kvbench.cli.app run "${RUN_ARGS[@]}"
  run_step memory bash -c "'$PY' -m kvbench.tools.activation_check --device cuda --dtype bfloat16 > '$OUT/activation-check.md'"
fi

{
  echo "# kvbench GPU check"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| triton', triton.__version__)" 2>&1
  echo "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (modified)')"
  echo '```'
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---:|"
  printf '%s' "$STATUS_ROWS"
  echo
  if [[ -f $OUT/bench.json ]]; then
    echo "## Decode attention micro-benchmarks"
    echo
    "$PY" benchmarks/gpu/summarize.py "$OUT/bench.json" 2>&1
    echo
  fi
  if [[ -f $OUT/run/summary.md ]]; then
    echo "## kvbench run ${RUN_ARGS[*]}"
    echo
    cat "$OUT/run/summary.md"
  fi
  if [[ -s $OUT/activation-check.md ]]; then
    echo
    echo "## Activation memory model vs torch.cuda.max_memory_allocated"
    echo
    cat "$OUT/activation-check.md"
  fi
} >"$SUMMARY"
cat "$SUMMARY"
exit "$FAILED"
