"""What bounds zeroscan.stats on cached data: the scan's vector loop taken apart.

bench_cpu.py measures stats() against x.sum(). At 1M-8M elements the data
sits in the caches, x.sum() reads it at cache speed, and the scan is bound by
the instructions it issues per 64-byte vector, not by memory. This script
times, on ONE thread and on one cached tensor of each dtype, each part of
that per-vector work alone (cpu_bound.cpp, built here from the very inline
functions of csrc/cpu/scan_span.h):

  classify  the counts (zero, subnormal, near-ulp, negative) and min/max |x|
  moments   the sums of x and x^2 (float8_e4m3fn: its four integer planes)
  both      the two together
  stats     zeroscan.stats(x) itself, single-threaded

each as a ratio to the floor of bench_cpu.py (x.sum(); 1-byte dtypes:
x.view(torch.float32).sum()) timed in the same run on the same tensor and
thread. If `classify` alone is near a target ratio, the target cannot be met
without dropping exact counts, whatever the moments cost.

    python benchmarks/bench_cpu_bound.py           # 1M elements, ~1 minute with the build
    python benchmarks/bench_cpu_bound.py --numel 8388608

Needs an x86-64 CPU with AVX-512 (float8_e4m3fn also VBMI and VNNI) and a
C++ compiler; the first run builds cpu_bound.cpp with torch's
cpp_extension (about 40 s). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.utils.cpp_extension

import zeroscan
from bench_cpu import Support, floor_fn
from timing import best_per_call, describe_machine, dtype_name, progress
from zeroscan.testing import make_distribution

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
PARTS = ("classify", "moments", "both")
HERE = Path(__file__).resolve().parent


def build():  # the compiled module (untyped: built at run time)
    progress("building cpu_bound.cpp (torch cpp_extension, ~40 s the first time)")
    return torch.utils.cpp_extension.load(
        name="zeroscan_cpu_bound",
        sources=[str(HERE / "cpu_bound.cpp")],
        extra_cflags=["-O3", "-ffp-contract=fast"],
        verbose=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements per tensor (default 1M)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per cell")
    args = parser.parse_args()
    if args.numel <= 0 or args.numel % 64:
        sys.exit(f"bench_cpu_bound.py: --numel must be a positive multiple of 64, got {args.numel}")
    if args.budget <= 0:
        sys.exit(f"bench_cpu_bound.py: --budget must be positive, got {args.budget}")
    parts = build()
    try:
        parts.time_part(torch.zeros(16), "both", 1)
    except RuntimeError as e:  # no AVX-512 here, or ZEROSCAN_CPU_CAPABILITY=scalar
        raise SystemExit(f"bench_cpu_bound.py: {str(e).splitlines()[0]}") from None
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"# What bounds the CPU scan — {describe_machine()}")
    print()
    print(f"{args.numel:,} elements, randn, one thread; each cell: its time / the floor's time in this run")
    print(f"(load average at the start: {os.getloadavg()[0]:.2f}).")
    print()
    print("| dtype | floor | floor time | classify | moments | both | stats(x) |")
    print("|---|---|---|---|---|---|---|")
    for dtype in DTYPES:
        name = dtype_name(dtype)
        progress(name)
        x = make_distribution("randn", args.numel, dtype=dtype, generator=g)
        support = Support(dtype)
        floor = best_per_call(floor_fn(x, support), args.budget)
        repeats = max(5, int(args.budget / max(floor, 1e-7) / 3))
        try:
            cells = [parts.time_part(x, part, repeats) / floor for part in PARTS]
        except RuntimeError as e:  # float8_e4m3fn's planes need VBMI and VNNI
            print(f"| {name} | {str(e).splitlines()[0]} |||||", flush=True)
            continue
        stats = best_per_call(lambda: zeroscan.stats(x), args.budget) / floor
        row = " | ".join(f"{c:.2f}×" for c in cells)
        print(f"| {name} | {support.floor_label()} | {floor * 1e6:.1f} µs | {row} | {stats:.2f}× |", flush=True)
    print()


if __name__ == "__main__":
    main()
