#!/usr/bin/env bash
# Builds zeroscan's CUDA extension in place (zeroscan/_C*.so) against PYTHON's
# torch: the one build recipe of .ci/cuda_torch_build.sh and
# benchmarks/gpu_check.sh.
#
#   bash .ci/build_cuda_extension.sh PYTHON      # from the checkout's root
#
# Environment: CUDA_HOME, TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS
# (default nproc).
set -euo pipefail
PYTHON=$1

# torch takes the toolkit from CUDA_HOME, else from the folder above nvcc's on
# PATH, which is wrong where that nvcc is a wrapper script outside the toolkit.
nvcc_root=$(dirname "$(dirname "$(command -v nvcc || echo /none/bin/nvcc)")")
if [[ -z ${CUDA_HOME:-} && ! -f $nvcc_root/include/cuda_runtime_api.h && -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDA_HOME=/usr/local/cuda PATH="/usr/local/cuda/bin:$PATH"
fi

# torch's CUDA headers include cuBLAS, cuSPARSE and cuSOLVER headers, which a
# toolkit may lack and torch's nvidia-* packages carry.
nvidia_include=$("$PYTHON" -c "import nvidia, pathlib; print(*sorted(str(p) for p in pathlib.Path(nvidia.__path__[0]).glob('cu[0-9]*/include')), sep=':')" 2>/dev/null || true)
arch="${TORCH_CUDA_ARCH_LIST:-9.0}"
jobs="${MAX_JOBS:-$(nproc)}"
echo "build: ZEROSCAN_CUDA=1 TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=$jobs (CPATH += ${nvidia_include:-nothing})"
CPATH="$nvidia_include${CPATH:+:$CPATH}" ZEROSCAN_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$jobs" \
  "$PYTHON" setup.py build_ext --inplace

# The extension must load the process's shared C++ runtime: one built with a
# static copy of libstdc++ (the GPU image's /opt/gcc/bin/g++ made one) died
# with SIGSEGV at the first error message that held a number. setup.py names
# -lstdc++ for this; a compiler that still links it statically fails here.
so="zeroscan/_C$("$PYTHON" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")"
needed=$(readelf -d "$so" | grep NEEDED || true)
if ! grep -q "libstdc++" <<<"$needed"; then
  echo "build: $so does not load the shared libstdc++.so.6 (a static copy is linked in?); it needs:" >&2
  echo "$needed" >&2
  exit 1
fi
