"""Every path of the CPU scan, reached on any machine.

The scan runs one of several builds of its vector loop (csrc/cpu/vec_scan.h:
AVX2, AVX-512; NEON on Arm, tested under qemu by test_span_check.py), or one
element at a time where the CPU has none of them; so does the histogram's
count (csrc/cpu/vec_fields.h). ZEROSCAN_CPU_CAPABILITY caps what the scan
may use, so the distribution suite runs again here under each cap, in a
fresh process (the cap is read once per process), against the float64
reference.

Under a cap the suites run without their largest size (200_003 elements, the
one that spans several 64K-element chunks): how chunks merge does not depend
on the cap, and that size is most of the suites' time, spent recomputing the
same float64 references. Every size that reaches a different part of the
capped loop (one element at a time, a ragged vector tail, whole blocks
between counter widenings) still runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # reruns whole suites in fresh processes: left out of the quick subset (-m "not slow")

TESTS = Path(__file__).resolve().parent
CAPPED_CASES = "not cuda and not 200003"  # pytest -k: the CPU cases, less the largest size (module doc)


def run_with_cap(cap: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ZEROSCAN_CPU_CAPABILITY": cap}
    return subprocess.run([sys.executable, *args], env=env, cwd=TESTS.parent, capture_output=True, text=True)


# native is the suite itself; avx512 runs the scan native runs wherever the
# CPU has AVX-512 (and AVX2's where it has not), so it adds nothing here.
@pytest.mark.parametrize("cap", ["scalar", "avx2"])
def test_distributions_under_capability(cap: str) -> None:
    """Every CPU test of test_distributions.py (each distribution, dtype,
    size and layout, and the edge cases after them), scanned within the
    cap, against the float64 reference."""
    result = run_with_cap(
        cap, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_distributions.py"), "-k", CAPPED_CASES
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


@pytest.mark.parametrize("cap", ["scalar", "avx2"])
def test_histograms_under_capability(cap: str) -> None:
    """The histogram's counts under the cap (one element at a time, or the
    AVX2 build's vector windows), against the same float64 reference as
    the native path."""
    result = run_with_cap(cap, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_histogram.py"), "-k", CAPPED_CASES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


def test_unknown_capability_is_refused() -> None:
    result = run_with_cap("avx9000", "-c", "import torch, zeroscan; zeroscan.stats(torch.ones(3))")
    assert result.returncode != 0
    assert "ZEROSCAN_CPU_CAPABILITY must be scalar, avx2, avx512 or native; got 'avx9000'" in result.stderr
