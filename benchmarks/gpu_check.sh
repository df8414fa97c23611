#!/usr/bin/env bash
# The whole GPU job in one script: build, correctness, sanitizers, benchmark.
#
#   bash benchmarks/gpu_check.sh                  # every stage, in the order below
#   bash benchmarks/gpu_check.sh build bench      # only these stages, in this order
#
# On a lent GPU, whose commands stop after 10 minutes, two calls do it all:
#   bash benchmarks/gpu_check.sh env build tests kernels sanitize   # ~8 min on an H100 (estimated)
#   bash benchmarks/gpu_check.sh build bench                        # ~6 min; build is skipped on a warm machine
# DEADLINE_S (default 560) bounds the whole call: each stage gets what is left,
# and a stage that would start with under 30 s left is reported as not run.
#
# Stages (each one's log is a file under $OUT; a summary table is printed last):
#   env       the GPU, driver, torch, nvcc and compute-sanitizer in use       -> build.log
#   build     `pip install --no-build-isolation --no-deps -e .` with the CUDA
#             kernels forced on (ZEROSCAN_CUDA=1, TORCH_CUDA_ARCH_LIST=9.0
#             unless set), then checks that every op has a CUDA kernel; skipped
#             when the built extension is newer than every csrc/ file        -> build.log
#   tests     the whole pytest suite (8 processes where pytest-xdist is
#             installed); fails if any test was skipped for want of a GPU
#             (other than for want of a second one)                          -> tests.log
#   kernels   .ci/cuda_check.sh: ptxas report (no stack frame, no spills) and
#             the torch-free standalone kernel test, run on the GPU           -> kernels.log
#   sanitize  compute-sanitizer memcheck and racecheck on the standalone test
#             (--small: sizes up to 70001, four value mixes) and on benchmarks/small_scan.py (every op, dtype and layout,
#             checked against the float64 reference; torch's caching
#             allocator off so that memcheck sees every allocation's bounds) -> sanitize.log
#   bench     benchmarks/bench_cuda.py, every section                         -> bench.log, bench.md, bench.json
#
# Environment: OUT (default build/gpu_check), PYTHON (default python3), JOBS
# (default nproc), BENCH_ARGS (extra arguments for bench_cuda.py, e.g.
# "--quick" or "--only training"), TESTS (pytest arguments, default "tests"),
# DEADLINE_S. At most 8 files are written under $OUT, so that all of them
# come back from a lent machine.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-build/gpu_check}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
TESTS="${TESTS:-tests}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.md"
ALL=(env build tests kernels sanitize bench)
DEADLINE_S="${DEADLINE_S:-560}"
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=("${ALL[@]}")
for s in "${STAGES[@]}"; do
  [[ " ${ALL[*]} " == *" $s "* ]] || { echo "gpu_check: unknown stage '$s' (stages: ${ALL[*]})" >&2; exit 2; }
done

declare -a ROWS=()
failed=0

# run_stage NAME LOG LIMIT_S COMMAND...: runs COMMAND with its output appended to LOG
# and echoed, bounded by LIMIT_S seconds, and records a summary row.
run_stage() {
  local name=$1 log=$2 limit=$3; shift 3
  local start=$SECONDS status left=$((DEADLINE_S - SECONDS))
  if [[ $left -lt 30 ]]; then
    ROWS+=("| $name | not run: ${left} s of DEADLINE_S=${DEADLINE_S} left | 0 s | |")
    failed=1
    return
  fi
  [[ $limit -gt $left ]] && limit=$left
  echo "== gpu_check: $name ($(date -u +%H:%M:%S), at most ${limit} s) -> $log"
  # The stage functions are exported: timeout runs them in a child bash.
  timeout --signal=INT --kill-after=20 "$limit" bash -c 'set -o pipefail; "$@"' _ "$@" 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
  local verdict=ok
  if [[ $status -eq 124 ]]; then verdict="TIMED OUT after ${limit} s"; failed=1
  elif [[ $status -ne 0 ]]; then verdict="FAILED (exit $status)"; failed=1; fi
  ROWS+=("| $name | $verdict | $((SECONDS - start)) s | $(basename "$log") |")
}

stage_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv || true
  "$PYTHON" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
EOF
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  command -v compute-sanitizer >/dev/null && compute-sanitizer --version | head -n 2
  "$PYTHON" -m pip list 2>/dev/null | grep -iE '^(torch|numpy|safetensors|pytest|pytest-xdist|hypothesis|transformers|accelerate|lightning|tensorboard|peft|ninja|pybind11) ' || true
  return 0
}

stage_build() {
  local so
  so=$(ls zeroscan/_C*.so 2>/dev/null | head -n 1)
  if [[ -n "$so" && -z "$(find csrc setup.py -newer "$so" -type f | head -n 1)" ]] && "$PYTHON" benchmarks/small_scan.py --kernels-only; then
    echo "build: $so is newer than every csrc/ file and has its CUDA kernels; not rebuilt"
    return 0
  fi
  ZEROSCAN_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="$JOBS" \
    "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -v -e . || return 1
  "$PYTHON" benchmarks/small_scan.py --kernels-only
}

stage_tests() {
  local xdist=() status report=/tmp/gpu_check_pytest.txt
  "$PYTHON" -c "import xdist" 2>/dev/null && xdist=(-n 8)
  # -rs lists every skip with its reason: the GPU tests must not be among them.
  # shellcheck disable=SC2086
  "$PYTHON" -m pytest $TESTS -q -rs "${xdist[@]}" -p no:cacheprovider 2>&1 | tee "$report"
  status=${PIPESTATUS[0]}
  if grep -E "^SKIPPED" "$report" | grep -iE "cuda|gpu" | grep -viE "two cuda devices|second (cuda )?device|several gpus"; then
    echo "tests: the tests above were skipped on a machine with a GPU"
    return 1
  fi
  return $status
}

stage_sanitize() {
  local standalone=build/cuda_check/standalone_test status=0
  # Without the caching allocator every tensor is its own allocation, so an
  # access past its end is out of bounds for memcheck, not inside a cached block.
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  if [[ -x $standalone ]]; then
    for tool in memcheck racecheck; do
      echo "-- compute-sanitizer --tool $tool $standalone --small"
      compute-sanitizer --tool "$tool" --error-exitcode 99 "$standalone" --small || status=1
    done
  else
    echo "sanitize: $standalone is missing (run the kernels stage first); only the Python scan is checked"
  fi
  for tool in memcheck racecheck; do
    echo "-- compute-sanitizer --tool $tool $PYTHON benchmarks/small_scan.py"
    compute-sanitizer --tool "$tool" --error-exitcode 99 "$PYTHON" benchmarks/small_scan.py || status=1
  done
  return $status
}

stage_bench() {
  # stdout (the tables) also to bench.md; bench.log gets the progress lines too.
  # shellcheck disable=SC2086
  "$PYTHON" benchmarks/bench_cuda.py --json "$OUT/bench.json" $BENCH_ARGS | tee "$OUT/bench.md"
}

BENCH_ARGS="${BENCH_ARGS:-}"
export OUT PYTHON JOBS TESTS BENCH_ARGS
export -f stage_env stage_build stage_tests stage_sanitize stage_bench
for stage in "${STAGES[@]}"; do
  case $stage in
    env) run_stage env "$OUT/build.log" 60 stage_env ;;
    build) run_stage build "$OUT/build.log" 300 stage_build ;;
    tests) run_stage tests "$OUT/tests.log" 360 stage_tests ;;
    kernels) run_stage kernels "$OUT/kernels.log" 180 bash .ci/cuda_check.sh ;;
    sanitize) run_stage sanitize "$OUT/sanitize.log" 300 stage_sanitize ;;
    bench) run_stage bench "$OUT/bench.log" 540 stage_bench ;;
  esac
  # A failed build leaves nothing to test.
  if [[ $stage == build && $failed -ne 0 ]]; then break; fi
done

{
  echo "| stage | result | time | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  grep -hE "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$OUT/tests.log" 2>/dev/null | tail -n 1
  grep -h "ERROR SUMMARY" "$OUT/sanitize.log" 2>/dev/null
  if [[ -f $OUT/bench.md ]]; then sed -n '/^## Summary/,$p' "$OUT/bench.md"; fi
} > "$SUMMARY"
echo
cat "$SUMMARY"
exit $failed
