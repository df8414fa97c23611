#!/usr/bin/env bash
# Compiles and links the whole CUDA extension against a CUDA build of torch,
# on a machine with nvcc and no GPU, and loads it: the launcher
# (csrc/cuda/stats_cuda.cpp) against torch's real CUDA headers, the link
# against libtorch_cuda, every op's CUDA kernel registered, and the CPU tests
# passing with the CUDA-enabled library. (.ci/cuda_check.sh compiles the
# kernels alone, without torch; the GPU machine runs them: benchmarks/gpu_check.sh.)
#
#   bash .ci/cuda_torch_build.sh
#
# It makes a throwaway virtualenv (about 6 GB: torch's CUDA wheel and its
# nvidia-* libraries) and a copy of the working tree under $WORK, and never
# touches the checkout's own build. Environment: TORCH_SPEC (default
# torch==2.14.1, a CUDA 13.0 build from the package index), WORK (default
# build/cuda_torch), NVCC's folder through CUDA_HOME (default /usr/local/cuda),
# JOBS (default nproc), TESTS (pytest arguments run against the CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC="${TORCH_SPEC:-torch==2.14.1}"
WORK="${WORK:-build/cuda_torch}"
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
JOBS="${JOBS:-$(nproc)}"
TESTS="${TESTS:-tests/test_stats.py tests/test_stats_many.py tests/test_histogram.py tests/test_distributed.py}"
VENV="$WORK/venv"
SRC="$WORK/src"
PY="$VENV/bin/python"

if [[ ! -x $CUDA_HOME/bin/nvcc ]]; then
  echo "cuda_torch_build: no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME)" >&2
  exit 1
fi
export PATH="$CUDA_HOME/bin:$PATH"

if [[ ! -x $PY ]]; then
  echo "== a throwaway virtualenv with $TORCH_SPEC in $VENV"
  python3 -m venv "$VENV"
fi
"$PY" -m pip install -q "$TORCH_SPEC" numpy ninja pybind11 safetensors setuptools wheel pytest hypothesis 2>&1 \
  | grep -v "^WARNING: Location" || true

nvcc_cuda=$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
torch_cuda=$("$PY" -c "import torch; print(torch.version.cuda or '')")
echo "== torch $("$PY" -c "import torch; print(torch.__version__)") (CUDA $torch_cuda), nvcc $nvcc_cuda"
if [[ -z $torch_cuda ]]; then
  echo "cuda_torch_build: $TORCH_SPEC is a CPU-only build; give TORCH_SPEC a CUDA build" >&2
  exit 1
fi
if [[ ${torch_cuda%%.*} != "${nvcc_cuda%%.*}" ]]; then
  echo "cuda_torch_build: torch is built for CUDA $torch_cuda but nvcc is $nvcc_cuda; the major versions must match" >&2
  exit 1
fi

echo "== copying the working tree to $SRC"
rm -rf "$SRC"
mkdir -p "$SRC"
git ls-files -co --exclude-standard | grep -v '^zeroscan/_C' | tar -cf - -T - | (cd "$SRC" && tar -xf -)

(
  cd "$SRC"
  MAX_JOBS="$JOBS" bash .ci/build_cuda_extension.sh "$PY" > "$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log"; echo "cuda_torch_build: the CUDA extension does not build" >&2; exit 1; }
  head -n 1 "$WORK/build.log"
  # Warnings in zeroscan's own sources (g++'s AVX-512 header noise is not ours).
  grep -E "csrc/[^ ]*: *warning" "$WORK/build.log" | sort -u || true
  so=$(ls zeroscan/_C*.so)
  echo "== built $so ($(du -h "$so" | cut -f1)); undefined symbols resolve at load:"
  export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"  # the copy's zeroscan, built in place
  "$PY" benchmarks/small_scan.py --kernels-only
  echo "== the CPU tests against the CUDA-enabled build (GPU tests skip: no GPU here)"
  # shellcheck disable=SC2086
  "$PY" -m pytest $TESTS -q -p no:cacheprovider -x
)
echo "cuda_torch_build: OK"
