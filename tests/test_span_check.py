"""The CPU's vector scan and histogram count of every build against their
element-at-a-time references, compiled without torch (tests/span_check.cpp).

Natively, every build this CPU runs (AVX2 and AVX-512 on x86-64). For
AArch64, the NEON build cross-compiled with Debian's g++-aarch64-linux-gnu
and run under qemu-user: Arm is built and tested here, though its speed is
not measured anywhere. Where ZEROSCAN_REQUIRE_ARM is set (.ci/run sets it
when it could install both), a missing cross compiler or qemu fails the
test instead of skipping it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # compiles the kernels again, ~15-45 s a case

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "span_check.cpp"
CPU = ROOT / "csrc" / "cpu"
# -Wno-maybe-uninitialized: GCC 12 warns inside its own AVX-512 headers (the undefined
# vectors of _mm512_castps512_ps256 and _mm512_cvtph_ps).
FLAGS = ["-O2", "-std=c++17", "-Wall", "-Wno-maybe-uninitialized", "-Werror"]


def build_and_run(compiler: str, sources: list[Path], out: Path, runner: list[str], *flags: str) -> str:
    subprocess.run([compiler, *FLAGS, *flags, "-o", str(out), str(CHECK), *map(str, sources)], check=True,
                   capture_output=True, text=True)
    result = subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return result.stdout


def test_native_vector_builds_match_the_reference(tmp_path: Path) -> None:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler {compiler!r}")
    out = build_and_run(compiler, sorted(CPU.glob("span_*.cpp")), tmp_path / "span_check", [])
    assert " 0 mismatches" in out, out
    if os.uname().machine == "x86_64":
        assert "avx2" in out, out  # every x86-64 CPU this runs on has AVX2


def test_neon_build_matches_the_reference_under_qemu(tmp_path: Path) -> None:
    compiler, qemu = "aarch64-linux-gnu-g++", "qemu-aarch64"
    missing = [tool for tool in (compiler, qemu) if shutil.which(tool) is None]
    if missing:
        if os.environ.get("ZEROSCAN_REQUIRE_ARM"):
            pytest.fail(f"ZEROSCAN_REQUIRE_ARM is set but {', '.join(missing)} is missing")
        pytest.skip(f"{', '.join(missing)} not installed (Debian: g++-aarch64-linux-gnu qemu-user)")
    out = build_and_run(compiler, [CPU / "span_neon.cpp"], tmp_path / "span_check_arm", [qemu], "-static")
    assert "neon:" in out and " 0 mismatches" in out, out
