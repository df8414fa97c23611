"""Builds zeroscan's native operators.

Install with `pip install --no-build-isolation -e .`: the extension is
compiled against the torch already installed, so torch must not be a build
requirement (an isolated build would fetch a different torch).

The CUDA kernels (csrc/cuda/) are built when the installed torch has CUDA
and nvcc is found. ZEROSCAN_CUDA=1 forces them (and fails loudly if that is
impossible); ZEROSCAN_CUDA=0 builds the CPU-only extension. The GPU
architectures follow TORCH_CUDA_ARCH_LIST, defaulting to 8.0 and 9.0.
"""

import glob
import os
import shutil

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch


def nvcc_path() -> str | None:
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


def build_cuda() -> bool:
    wanted = os.environ.get("ZEROSCAN_CUDA", "auto").lower()
    possible = torch.version.cuda is not None and nvcc_path() is not None
    if wanted in ("0", "false", "no", "off"):
        return False
    if wanted in ("1", "true", "yes", "on"):
        if not possible:
            raise RuntimeError(
                "ZEROSCAN_CUDA=1 but the CUDA extension cannot be built: "
                f"torch.version.cuda={torch.version.cuda!r}, nvcc={nvcc_path()!r}"
            )
        return True
    return possible


# The extension links the process's shared C++ runtime, libstdc++.so.6, named
# here because a compiler may link a static copy by default (the GPU image's
# /opt/gcc/bin/g++ did). That second copy does not share the process's
# locale: formatting a number into an error message ("xs[1] has unsupported
# dtype") killed the process with SIGSEGV there, and cuts the message short
# where both copies are the same version. The copy torch has loaded into
# this process is named by its path, ahead of the compiler's own: a bare
# -lstdc++ still found the static one with /opt/gcc/bin/g++ (2026-11-29).
def shared_libstdcxx() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()  # address perms offset dev inode [path]
                path = fields[5] if len(fields) > 5 else ""
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return [path]
    except OSError:
        pass
    return ["-lstdc++"]


LINK = ["-fopenmp", *shared_libstdcxx()]


def extension():
    cxx = ["-O3", "-fopenmp", "-ffp-contract=fast"]
    sources = ["csrc/zeroscan.cpp", "csrc/tensor_meta.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    if not build_cuda():
        return CppExtension(
            "zeroscan._C",
            sources,
            extra_compile_args={"cxx": cxx},
            extra_link_args=LINK,
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
    return CUDAExtension(
        "zeroscan._C",
        sources,
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"]},
        extra_link_args=LINK,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
