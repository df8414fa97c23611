"""What bounds the CPU scan on cached data: each vector build's span loop
alone (csrc/cpu/vec_scan.h, built with benchmarks/span_speed.cpp, no torch),
one thread, nanoseconds per element over a 64K-element span that stays in
the core's caches, for every build this CPU runs (scalar, AVX2, AVX-512, or
NEON on Arm), float32, bfloat16, float16 and float8_e4m3fn, and the
distributions whose passes differ (dense, half zeros, all subnormal, 0.1 %,
3 % and 30 % subnormal, 0.01 %, 0.1 % and 1 % NaN/Inf). Each build's column has a twin,
BUILD+histogram: the same scan with the histogram's count as a chunk runs it
(in the scan's loop where the build counts there, else a pass of its own
after it). Then what a span of 16 to 64K float32 elements costs per call,
the scan's fixed cost among it.

A build is memory-bound at 64M elements when its time here is below the
time per element one core's share of memory bandwidth allows (bench_cpu.py's
floor: x.sum() time / elements x threads). Its time here over that share
bounds its 64M ratio to the fastest floor from below, whatever the scan
overlaps with memory.

    python benchmarks/bench_span.py          # needs a C++17 compiler (CXX, default g++)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from timing import describe_machine, progress

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    compiler = os.environ.get("CXX", "g++")
    sources = [ROOT / "benchmarks" / "span_speed.cpp", *sorted((ROOT / "csrc" / "cpu").glob("span_*.cpp"))]
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "span_speed"
        progress(f"building span_speed with {compiler}")
        subprocess.run([compiler, "-O3", "-std=c++17", "-o", str(binary), *map(str, sources)], check=True)
        progress("running")
        out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    cells: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    builds: list[str] = []
    per_call: dict[int, dict[str, float]] = defaultdict(dict)  # span size -> build -> ns per call
    sum_ns = 0.0
    for line in out.splitlines():
        build, dtype, dist, ns = line.split()
        if build == "sum":
            sum_ns = float(ns)
            continue
        if build == "size":  # "size BUILD ELEMENTS NS"
            per_call[int(dist)][dtype] = float(ns)
            continue
        if build not in builds:
            builds.append(build)
        cells[(dtype, dist)][build] = float(ns)
    print(f"# The span loop alone, cached, one thread — {describe_machine()}")
    print()
    print(f"ns per element; a plain float32 sum of the same span: {sum_ns:.3f} ns per element.")
    print()
    print("| dtype | distribution | " + " | ".join(builds) + " |")
    print("|---|---|" + "---|" * len(builds))
    for (dtype, dist), by_build in cells.items():
        print(f"| {dtype} | {dist} | " + " | ".join(f"{by_build[b]:.3f}" for b in builds) + " |")
    print()
    print("A span's fixed cost: float32 randn spans, ns per call (its setup and end included).")
    print()
    sized = [b for b in builds if any(b in by_build for by_build in per_call.values())]  # not BUILD+histogram
    print("| elements | " + " | ".join(sized) + " |")
    print("|---|" + "---|" * len(sized))
    for n, by_build in per_call.items():
        print(f"| {n:,} | " + " | ".join(f"{by_build[b]:.1f}" for b in sized) + " |")
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
