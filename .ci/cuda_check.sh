#!/usr/bin/env bash
# CI for the CUDA kernels, on a machine with nvcc and usually no GPU.
#
# 1. Compiles every kernel file (csrc/cuda/*.cu) for sm_80 and
#    sm_90 with `nvcc -Xptxas -v`, with the flags torch's build uses, and
#    fails if any function has a stack frame or spills registers (local
#    memory in a memory-bound kernel costs bandwidth): at the end, so that
#    steps 2-4 still run.
# 2. Builds the torch-free test program (tests/standalone_test.cu).
# 3. Runs it on the GPU if there is one. Without a GPU it checks that the
#    program says so, then runs its --emulate mode, which executes the
#    kernels' per-thread code on the CPU against the same reference
#    (ZEROSCAN_CUDA_EMULATE=0 skips that).
# 4. Costs the contiguous scan statically (benchmarks/sass_cost.py): issue
#    slots per element read off the SASS, weighted by pipe, and fails when
#    float32, bfloat16, float16 or a float8 type is over its budget. nvdisasm comes from the
#    toolkit or, when missing, the PyPI wheel nvidia-cuda-nvdisasm
#    (ZEROSCAN_SASS_COST=0 skips the stage).
#
# Environment: NVCC (default: $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc,
# or nvcc on PATH), BUILD_DIR (default build/cuda_check), JOBS (default nproc),
# STANDALONE_ARGS (the GPU run's arguments, e.g. --small: on an H200 the
# default run had not finished 180 s into the stage, compiles included).
set -euo pipefail

cd "$(dirname "$0")/.."

find_nvcc() {
  if [[ -n "${NVCC:-}" ]]; then echo "$NVCC"; return; fi
  for c in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    if [[ -x "$c" ]]; then echo "$c"; return; fi
  done
  command -v nvcc || true
}
NVCC="$(find_nvcc)"
if [[ -z "$NVCC" ]]; then
  echo "cuda_check: nvcc not found (set NVCC or CUDA_HOME)" >&2
  exit 1
fi
BUILD_DIR="${BUILD_DIR:-build/cuda_check}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$BUILD_DIR"
"$NVCC" --version | tail -n 2

# What torch.utils.cpp_extension passes to nvcc, plus setup.py's own flags.
# _FORTIFY_SOURCE as Ubuntu's g++ defines it when optimizing (the GPU image's
# host compiler): device code must compile the same with and without it.
FLAGS=(-std=c++20 -O3 -lineinfo -Xcompiler=-D_FORTIFY_SOURCE=3
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       --expt-relaxed-constexpr
       -gencode=arch=compute_80,code=sm_80
       -gencode=arch=compute_90,code=sm_90)

KERNELS=(csrc/cuda/stats_cuda_*.cu csrc/cuda/nonfinite_cuda_kernels.cu)
echo "== compiling ${#KERNELS[@]} kernel files for sm_80 and sm_90 (ptxas -v)"
export NVCC BUILD_DIR
printf '%s\n' "${KERNELS[@]}" | xargs -P "$JOBS" -I{} bash -c '
  f={}; b=$(basename "$f" .cu)
  if ! "$NVCC" "$@" -Xptxas -v -c "$f" -o "$BUILD_DIR/$b.o" \
       >"$BUILD_DIR/$b.log" 2>&1; then
    cat "$BUILD_DIR/$b.log"; echo "cuda_check: $f does not compile" >&2; exit 255
  fi' _ "${FLAGS[@]}"

# ptxas -v prints, per function and architecture:
#   Compiling entry function '<name>' for 'sm_90'
#   Function properties for <name>
#       N bytes stack frame, N bytes spill stores, N bytes spill loads
#   Used N registers, ...
status=0
for f in "${KERNELS[@]}"; do
  b=$(basename "$f" .cu)
  if ! awk -v file="$b" '
    /Compiling entry function/ {
      match($0, /sm_[0-9]+/); arch = substr($0, RSTART, RLENGTH)
      entries[arch]++
    }
    /Function properties for/ { fn = $NF }
    /bytes stack frame/ {
      stack = $1; stores = $5; loads = $9
      if (stack + 0 > 0 || stores + 0 > 0 || loads + 0 > 0) {
        printf "FAIL %s %s: %s\n", file, fn, $0; bad = 1
      }
    }
    /Used [0-9]+ registers/ {
      match($0, /Used [0-9]+ registers/)
      regs = substr($0, RSTART + 5, RLENGTH - 15)
      short = fn; sub(/^_ZN8zeroscan4cuda[0-9]+/, "", short)
      printf "  %-16s %-5s %3d regs  %s\n", file, arch, regs, substr(short, 1, 48)
    }
    END {
      # A dtype file holds a contiguous and a strided kernel; the merge file one
      # kernel; the non-finite marker one per floating dtype.
      want = file == "stats_cuda_combine" ? 1 : file == "nonfinite_cuda_kernels" ? 6 : 2
      if (entries["sm_80"] < want || entries["sm_90"] < want) {
        printf "FAIL %s: expected kernels for sm_80 and sm_90 in the ptxas report\n", file
        bad = 1
      }
      exit bad
    }' "$BUILD_DIR/$b.log"; then
    status=1
  fi
  if grep -qi "warning" "$BUILD_DIR/$b.log"; then
    grep -i "warning" "$BUILD_DIR/$b.log" | sort -u
  fi
done
# A spill fails the check at the end, after the standalone test has run: the
# test (and the GPU job's sanitizers, which run it) still say whether the
# kernels are right.
ptxas_status=$status
if [[ $ptxas_status -ne 0 ]]; then
  echo "cuda_check: stack frames or register spills (see above); the check fails after the kernel test" >&2
else
  echo "== every kernel: 0 bytes stack frame, 0 bytes spilled, on sm_80 and sm_90"
fi

echo "== building the standalone test program"
TEST_FLAGS=("${FLAGS[@]}")
"$NVCC" "${TEST_FLAGS[@]}" \
  tests/standalone_test.cu "$BUILD_DIR"/stats_cuda_*.o \
  -o "$BUILD_DIR/standalone_test"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "== running the standalone test on the GPU ${STANDALONE_ARGS:-}"
  # shellcheck disable=SC2086
  "$BUILD_DIR/standalone_test" ${STANDALONE_ARGS:-}
else
  echo "== no GPU: the kernels are compiled but not run"
  "$BUILD_DIR/standalone_test" --skip-without-gpu
  if [[ "${ZEROSCAN_CUDA_EMULATE:-1}" != "0" ]]; then
    echo "== running the kernels' per-thread code on the CPU (--emulate)"
    "$BUILD_DIR/standalone_test" --emulate
  fi
fi

if [[ "${ZEROSCAN_SASS_COST:-1}" != "0" ]]; then
  echo "== static cost of the scan (benchmarks/sass_cost.py)"
  PY=python3
  [[ -x .venv/bin/python ]] && PY=.venv/bin/python
  if ! "$PY" -c 'import sys; sys.path.insert(0, "benchmarks"); import sass_cost; sass_cost.find_tool("nvdisasm", "NVDISASM")' \
       >/dev/null 2>&1; then
    echo "   nvdisasm not found: installing the nvidia-cuda-nvdisasm wheel"
    "$PY" -m pip install --quiet 'nvidia-cuda-nvdisasm>=13,<14'
  fi
  export NVCC
  "$PY" benchmarks/sass_cost.py --self-test
  "$PY" benchmarks/sass_cost.py --check
fi
if [[ $ptxas_status -ne 0 ]]; then
  echo "cuda_check: FAILED: stack frames or register spills (see the ptxas report above)" >&2
  exit 1
fi
echo "cuda_check: OK"
