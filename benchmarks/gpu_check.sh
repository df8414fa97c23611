#!/usr/bin/env bash
# The GPU job in one script: build, correctness, sanitizers, benchmark.
#
#   bash benchmarks/gpu_check.sh call1            # the first call on a lent GPU (below)
#   bash benchmarks/gpu_check.sh call2            # the second, if time is left
#   bash benchmarks/gpu_check.sh build bench      # any stages, in this order
#   bash benchmarks/gpu_check.sh build+kernels    # '+' runs stages at the same time
#   bash benchmarks/gpu_check.sh tests:120        # ':N' caps a stage at N seconds
#
# A lent GPU gives a session 15 minutes of device time, the machine's start
# (about 45 s on an H200) and idle time included, so the job is two calls.
# What each stage took on an H200 (2026-11-27, 16 cores): env 7 s, build
# 50 s, bench of call1 39 s (two dtypes then; four since 2026-12-01, not yet
# timed) and of call2 36 s, nccl 62 s; the CUDA tests ran
# about 6 tests/s on 12 workers beside a sanitizer (2,660 would take ~450 s),
# the default standalone run had not ended 180 s into the kernels stage, and
# the Python small scan under memcheck had not ended after 150 s.
#   call1  (DEADLINE_S=380; give the call timeout_s=420) decides whether the
#          GPU path is right: env, build+kernels (the extension for sm_90
#          alone while .ci/cuda_check.sh builds the standalone kernel test and
#          runs it with --small), backtrace (the tests that crashed, under a
#          debugger), memcheck on that standalone test, bench (the
#          bandwidth table at 1 GB for float32, bfloat16, float16 and
#          float8_e4m3fn, every distribution, host syncs per call, CUDA-graph
#          replay), the CUDA tests of $CALL1_TESTS (all of them), then
#          racecheck on the standalone test for what is left of the deadline
#          (on 2026-11-30 call1 ended 240 s before it). A racecheck still
#          running at the deadline is reported TIMED OUT and call1 exits 1:
#          the summary's other rows still hold.
#   call2  (DEADLINE_S=210; timeout_s=240): bench's stats_many rows (7B
#          shapes, 2,000 small tensors) and the Monitor on a 1B training
#          step, racecheck+nccl (the standalone test --small; test_nccl.py on
#          a one-GPU NCCL world), then the CUDA tests of $CALL2_TESTS
#          (test_cuda.py's again).
#          If call1 found a bug, call2 is call1 again after the fix.
# call1 leaves $OUT/build.tgz (the extension, its sources' digest and the
# standalone test): unpacked into the working tree and carried (carry:
# zeroscan/_C.cpython-312-x86_64-linux-gnu.so, zeroscan/_C.sources,
# build/cuda_check/standalone_test), it spares a fresh machine the build.
# Left out of both: the default (full-size) standalone run and the Python
# small scan under the sanitizers, which do not fit.
#
# Stages (each logs to a file under $OUT/logs, packed into $OUT/logs.tgz at
# the end; a summary table is printed last and written to $OUT/summary.md):
#   env       the GPU, driver, torch, nvcc and compute-sanitizer in use       -> build.log
#   build     .ci/build_cuda_extension.sh (`setup.py build_ext --inplace` with
#             the CUDA kernels forced on, TORCH_CUDA_ARCH_LIST=9.0 unless set), then a
#             check that every op has a CUDA kernel; skipped when
#             zeroscan/_C.sources holds the digest of csrc/, setup.py and the standalone test -> build.log
#   kernels   .ci/cuda_check.sh: ptxas report (no stack frame, no spills) and
#             the torch-free standalone kernel test, run on the GPU           -> kernels.log
#   tests     pytest over $TESTS (default tests) with -k "$TESTS_K" when set,
#             $TEST_WORKERS processes (default 4) where pytest-xdist is
#             installed, stopped by pytest-timeout's --session-timeout before
#             the stage's limit so that its failures are still reported; fails
#             if a test was skipped for want of a GPU (other than a second one) -> tests.log
#   memcheck  compute-sanitizer memcheck on the standalone test (--small) and,
#   racecheck unless SANITIZE_PYTHON=0, on benchmarks/small_scan.py (every op,
#             dtype and layout against the float64 reference, torch's caching
#             allocator off so that memcheck sees every allocation's bounds)  -> sanitize.log
#   backtrace $BACKTRACE_TESTS (pytest node ids) in one process under
#             cuda-gdb (or gdb), which prints every thread's C++ stack if it
#             crashes; by default the tests that crashed their process on an
#             H200 (a CUDA refusal by stats_many_hist or stats_many_mapped)   -> crash.log
#   nccl      tests/test_nccl.py: zeroscan.distributed and the Monitor on an
#             NCCL world of every GPU (up to 4) against the same on gloo      -> nccl.log
#   bench     benchmarks/bench_cuda.py $BENCH_ARGS                            -> bench.log, $OUT/bench.md, $OUT/bench.json
#
# Environment: OUT (default build/gpu_check), PYTHON (default python3), JOBS
# (default nproc), BENCH_ARGS, TESTS, TESTS_K, TEST_WORKERS, SANITIZE_PYTHON,
# STANDALONE_ARGS (.ci/cuda_check.sh's), DEADLINE_S (default 560: the
# whole run; a stage gets what is left, and one that would start with under
# 30 s left is reported as not run). At most 8 files are left under $OUT, so
# that all of them come back from a lent machine.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-build/gpu_check}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
TESTS="${TESTS:-}"
TESTS_K="${TESTS_K:-}"
BENCH_ARGS="${BENCH_ARGS:-}"
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(env build+kernels tests memcheck racecheck nccl bench)
# The CUDA tests, the most telling first: call1 runs all of them (every
# test_*.py with a "cuda" case but test_nccl.py, the nccl stage, and
# test_gpu_job.py, which runs on the CPU). They were ~3,360 cases; the small
# inputs of one dtype and device are now checked in one case (tests/checklist.py),
# ~470 cases, and each pytest-xdist worker takes its share of the cores for
# torch's threads (tests/conftest.py). Estimated, not yet timed on a GPU, at
# ~50 s on 4 workers (each case its CPU-side time plus 0.1 s) of a ~250 s budget.
# call2 runs test_cuda.py's GPU-only checks (streams, syncs, graphs, tiles)
# again, on another machine.
CALL1_TESTS="tests/test_cuda.py tests/test_stats.py tests/test_diagnosis.py tests/test_errors.py
  tests/test_mapped_scan.py tests/test_cuda_monitor.py tests/test_compile.py tests/test_stats_many.py tests/test_monitor.py
  tests/test_mark_nonfinite.py tests/test_distributions.py tests/test_extremes.py tests/test_histogram.py"
CALL2_TESTS="tests/test_cuda.py"
case "${STAGES[*]}" in
  call1)
    STAGES=(env build+kernels backtrace:90 memcheck:90 bench tests racecheck)
    DEADLINE_S="${DEADLINE_S:-380}"
    BENCH_ARGS="${BENCH_ARGS:---sizes 1024 --only bandwidth,syncs,graphs}"
    TESTS="${TESTS:-$CALL1_TESTS}" TESTS_K="${TESTS_K:-cuda}"
    # A plan's sanitizers read the standalone test alone: the Python scan under them does not fit.
    SANITIZE_PYTHON="${SANITIZE_PYTHON:-0}" STANDALONE_ARGS="${STANDALONE_ARGS:---small}" ;;
  call2)
    STAGES=(env build bench racecheck:120+nccl:120 tests)
    DEADLINE_S="${DEADLINE_S:-210}"
    BENCH_ARGS="${BENCH_ARGS:---only many,training}"
    TESTS="${TESTS:-$CALL2_TESTS}" TESTS_K="${TESTS_K:-cuda}"
    SANITIZE_PYTHON="${SANITIZE_PYTHON:-0}" STANDALONE_ARGS="${STANDALONE_ARGS:---small}" ;;
esac
case "${STAGES[*]}" in
  *call1*|*call2*) echo "gpu_check: call1 and call2 are whole plans; give one alone" >&2; exit 2 ;;
esac
TESTS="${TESTS:-tests}"
TEST_WORKERS="${TEST_WORKERS:-4}"
SANITIZE_PYTHON="${SANITIZE_PYTHON:-1}"
STANDALONE_ARGS="${STANDALONE_ARGS:-}"
DEADLINE_S="${DEADLINE_S:-560}"
KNOWN=(env build kernels tests memcheck racecheck backtrace nccl bench)
for group in "${STAGES[@]}"; do
  IFS=+ read -ra members <<<"$group"
  for member in "${members[@]}"; do
    s=${member%%:*}
    [[ " ${KNOWN[*]} " == *" $s "* ]] || { echo "gpu_check: unknown stage '$s' (stages: ${KNOWN[*]}, or call1 / call2)" >&2; exit 2; }
    if [[ $member == *:* && ! ${member#*:} =~ ^[1-9][0-9]*$ ]]; then
      echo "gpu_check: '$member': a stage's limit is whole seconds, at least 1 (as in tests:120)" >&2
      exit 2
    fi
  done
done

mkdir -p "$OUT/logs"
# What an earlier run left in $OUT would pass for this run's.
rm -f "$OUT"/{bench.md,bench.json,build.tgz,summary.md,logs.tgz} "$OUT"/logs/*
LOGS="$OUT/logs"
ROWS="$OUT/logs/rows.md"  # one summary row per stage, appended by concurrent stages too
: >"$ROWS"
export PYTHONUNBUFFERED=1
# The extension is built in place: every process, pytest's workers included, imports it from here.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS

# run_stage NAME LOG DEFAULT_LIMIT_S QUIET COMMAND...: runs COMMAND with its output
# appended to LOG (and echoed unless QUIET), bounded by the stage's limit and
# by what is left of DEADLINE_S, and appends its summary row to $ROWS.
run_stage() {
  local name=$1 log=$2 limit=$3 quiet=$4; shift 4
  local start=$SECONDS status left=$((DEADLINE_S - (SECONDS - START)))
  if [[ $left -lt 30 ]]; then
    echo "| $name | not run: ${left} s of DEADLINE_S=${DEADLINE_S} left | 0 s | |" >>"$ROWS"
    return 1
  fi
  [[ $limit -gt $left ]] && limit=$left
  echo "== gpu_check: $name ($(date -u +%H:%M:%S), at most ${limit} s) -> $log"
  # The stage functions are exported: timeout runs them in a child bash. Every tee
# is `tee -i`: timeout's SIGINT reaches the whole stage, and a tee that died of
# it would lose what pytest prints as it stops (its failures and tracebacks).
  if [[ $quiet == 1 ]]; then
    # A background job starts with SIGINT ignored, so a quiet stage is stopped with SIGTERM.
    STAGE_LIMIT=$limit timeout --signal=TERM --kill-after=20 "$limit" bash -c 'set -o pipefail; "$@"' _ "$@" >>"$log" 2>&1
    status=$?
  else
    STAGE_LIMIT=$limit timeout --signal=INT --kill-after=20 "$limit" bash -c 'set -o pipefail; "$@"' _ "$@" 2>&1 | tee -ai "$log"
    status=${PIPESTATUS[0]}
  fi
  local verdict=ok
  if [[ $status -eq 124 ]]; then verdict="TIMED OUT after ${limit} s"
  elif [[ $status -ne 0 ]]; then verdict="FAILED (exit $status)"; fi
  echo "== gpu_check: $name: $verdict in $((SECONDS - start)) s"
  echo "| $name | $verdict | $((SECONDS - start)) s | $(basename "$log") |" >>"$ROWS"
  [[ $verdict == ok ]]
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
  # Settings that change what torch does (its error messages, launches, collectives).
  env | grep -E "^(TORCH|PYTORCH|CUDA|NCCL)_" | sort || true
  "$PYTHON" -m pip list 2>/dev/null | grep -iE '^(torch|numpy|safetensors|pytest|pytest-xdist|pytest-timeout|hypothesis|transformers|accelerate|lightning|ninja|pybind11) ' || true
  return 0
}

# The digest of what the extension is built from: a build is reused only while it matches.
sources_digest() {
  find csrc setup.py tests/standalone_test.cu -type f | LC_ALL=C sort | xargs cat | sha256sum | cut -d' ' -f1
}

stage_build() {
  local so stamp=zeroscan/_C.sources want
  want=$(sources_digest)
  so=$(ls zeroscan/_C*.so 2>/dev/null | head -n 1)
  if [[ -n $so && -f $stamp && "$(cat "$stamp")" == "$want" ]] && "$PYTHON" benchmarks/small_scan.py --kernels-only; then
    echo "build: $so was built from these sources ($stamp) and has its CUDA kernels; not rebuilt"
    return 0
  fi
  rm -f zeroscan/_C*.so "$stamp"
  MAX_JOBS="$JOBS" bash .ci/build_cuda_extension.sh "$PYTHON" || return 1
  "$PYTHON" benchmarks/small_scan.py --kernels-only || return 1
  echo "$want" >"$stamp"
}

stage_tests() {
  # -v: each test's result is logged when it ends, so a stage stopped at its limit still names its failures.
  local args=(-v -rfs -p no:cacheprovider) status report=/tmp/gpu_check_pytest.txt
  # Few workers: each is a CUDA context, and the GPU time-slices between contexts.
  "$PYTHON" -c "import xdist" 2>/dev/null && args+=(-n "$TEST_WORKERS")
  # One hung test must not take the whole stage with it, and the session ends
  # itself before the stage's limit, so that it still reports its failures.
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && args+=(--timeout 100 --session-timeout $((STAGE_LIMIT - 20)))
  [[ -n $TESTS_K ]] && args+=(-k "$TESTS_K")
  # -rs lists every skip with its reason: the GPU tests must not be among them.
  # shellcheck disable=SC2086
  "$PYTHON" -m pytest $TESTS "${args[@]}" 2>&1 | tee -i "$report"
  status=${PIPESTATUS[0]}
  # Stopped by its session timeout: the stage ran out of time, as a stage killed at its limit does.
  grep -q "session-timeout: .* exceeded" "$report" && status=124
  if grep -E "^SKIPPED" "$report" | grep -iE "cuda|gpu" | grep -viE "two cuda devices|second (cuda )?device|several gpus"; then
    echo "tests: the tests above were skipped on a machine with a GPU"
    return 1
  fi
  return $status
}

BACKTRACE_TESTS="${BACKTRACE_TESTS:-tests/test_errors.py::test_every_refusal_names_the_call_and_argument_used[uint16-cuda]
  tests/test_mapped_scan.py::test_cuda_tensors_refused_in_one_line}"

# A segfault in a pytest worker shows only Python frames; this shows where in C++.
stage_backtrace() {
  local gdb
  gdb=$(command -v cuda-gdb || command -v gdb) || { echo "backtrace: neither cuda-gdb nor gdb is installed"; return 1; }
  local report=/tmp/gpu_check_gdb.txt
  set -f  # node ids hold [..], which a shell would glob
  # shellcheck disable=SC2086
  "$gdb" -q -batch -ex "set pagination off" -ex "set print thread-events off" -ex run \
    -ex "thread apply all bt 40" --args "$PYTHON" -m pytest -p no:cacheprovider -q -rfE $BACKTRACE_TESTS 2>&1 | tee -i "$report"
  # gdb's exit status is its own: the run's result is in what it printed.
  if grep -q "received signal SIG" "$report"; then
    echo "backtrace: the tests crashed; the stacks are above"
    return 1
  fi
  grep -qE "[0-9]+ passed" "$report" && ! grep -qE "[0-9]+ (failed|error)" "$report"
}

stage_nccl() {
  "$PYTHON" -m pytest tests/test_nccl.py -q -rs -p no:cacheprovider -k nccl
}

# stage_sanitize TOOL: compute-sanitizer TOOL on the standalone test and on the small scan.
stage_sanitize() {
  local tool=$1 standalone=build/cuda_check/standalone_test status=0
  # Without the caching allocator every tensor is its own allocation, so an
  # access past its end is out of bounds for memcheck, not inside a cached block.
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  if [[ -x $standalone ]]; then
    echo "-- compute-sanitizer --tool $tool $standalone --small"
    compute-sanitizer --tool "$tool" --error-exitcode 99 "$standalone" --small || status=1
  else
    echo "sanitize: $standalone is missing (the kernels stage builds it); only the Python scan is checked"
  fi
  if [[ ${SANITIZE_PYTHON:-1} == 0 ]]; then
    echo "sanitize: SANITIZE_PYTHON=0: benchmarks/small_scan.py is not run under $tool"
    if [[ ! -x $standalone ]]; then
      echo "sanitize: nothing was checked"
      return 1
    fi
    return $status
  fi
  echo "-- compute-sanitizer --tool $tool $PYTHON benchmarks/small_scan.py"
  compute-sanitizer --tool "$tool" --error-exitcode 99 "$PYTHON" benchmarks/small_scan.py || status=1
  return $status
}

stage_bench() {
  # The tables (stdout) also to bench.md; bench.log gets the progress lines too.
  # shellcheck disable=SC2086
  "$PYTHON" benchmarks/bench_cuda.py --json "$OUT/bench.json" $BENCH_ARGS | tee -i "$OUT/bench.md"
}

export OUT PYTHON JOBS TESTS TESTS_K TEST_WORKERS SANITIZE_PYTHON STANDALONE_ARGS BENCH_ARGS BACKTRACE_TESTS
export -f stage_env sources_digest stage_build stage_tests stage_backtrace stage_nccl stage_sanitize stage_bench

# one_stage NAME[:LIMIT] QUIET: runs one stage; its default limit unless LIMIT is given.
one_stage() {
  local name=${1%%:*} limit="" quiet=$2
  [[ $1 == *:* ]] && limit=${1#*:}
  case $name in
    env) run_stage env "$LOGS/build.log" "${limit:-60}" "$quiet" stage_env ;;
    build) run_stage build "$LOGS/build.log" "${limit:-300}" "$quiet" stage_build ;;
    # The static cost check (sass_cost.py) needs no GPU and may want a wheel this
    # machine cannot fetch: CI runs it, the lent machine's time goes elsewhere.
    kernels) run_stage kernels "$LOGS/kernels.log" "${limit:-180}" "$quiet" env ZEROSCAN_SASS_COST=0 bash .ci/cuda_check.sh ;;
    tests) run_stage tests "$LOGS/tests.log" "${limit:-360}" "$quiet" stage_tests ;;
    memcheck) run_stage memcheck "$LOGS/sanitize.log" "${limit:-300}" "$quiet" stage_sanitize memcheck ;;
    racecheck) run_stage racecheck "$LOGS/sanitize.log" "${limit:-300}" "$quiet" stage_sanitize racecheck ;;
    nccl) run_stage nccl "$LOGS/nccl.log" "${limit:-180}" "$quiet" stage_nccl ;;
    backtrace) run_stage backtrace "$LOGS/crash.log" "${limit:-120}" "$quiet" stage_backtrace ;;
    bench) run_stage bench "$LOGS/bench.log" "${limit:-540}" "$quiet" stage_bench ;;
  esac
}

for group in "${STAGES[@]}"; do
  IFS=+ read -ra members <<<"$group"
  if [[ ${#members[@]} -eq 1 ]]; then
    one_stage "${members[0]}" 0
  else
    # Stages run at the same time log quietly, each to its own file (none is timed).
    pids=()
    for member in "${members[@]}"; do
      one_stage "$member" 1 &
      pids+=($!)
    done
    wait "${pids[@]}"
  fi
  # A failed build leaves nothing to test.
  if grep -qE "^\| build \| (FAILED|TIMED|not run)" "$ROWS"; then break; fi
done

# What a later call on a fresh machine carries instead of building again (once this run built or checked it).
built=(zeroscan/_C*.so zeroscan/_C.sources build/cuda_check/standalone_test)
existing=()
for f in "${built[@]}"; do [[ -f $f ]] && existing+=("$f"); done
if grep -q "^| build | ok |" "$ROWS" && [[ -f zeroscan/_C.sources ]]; then
  tar czf "$OUT/build.tgz" "${existing[@]}"
fi

failed=0
grep -qv "^| [a-z]* | ok |" "$ROWS" && failed=1
{
  echo "| stage | result | time | log |"
  echo "|---|---|---|---|"
  cat "$ROWS"
  grep -hE "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$LOGS/tests.log" "$LOGS/nccl.log" 2>/dev/null
  grep -h "ERROR SUMMARY" "$LOGS/sanitize.log" 2>/dev/null
  if [[ -f $OUT/bench.md ]]; then sed -n '/^## Summary/,$p' "$OUT/bench.md"; fi
} >"$OUT/summary.md"
rm -f "$ROWS"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
echo
cat "$OUT/summary.md"
exit $failed
