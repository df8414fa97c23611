"""stats(x, histogram=True): what the log2-magnitude histogram adds to the scan.

For each dtype and every value distribution of zeroscan.testing, at one size
(64M elements by default), times in the same run:

  x.sum()                     the memory-bandwidth floor
  stats(x)                    the scan without the histogram
  stats(x, histogram=True)    the scan with it
  naive                       what users write for the same bins today:
                              torch.frexp of |x| and a bincount of the exponents,
                              plus the zero / subnormal / NaN / Inf counts

and prints stats+histogram as a ratio to x.sum() and to stats(x), the worst
distribution last. Best of five batches per timing; nothing is asserted.

    python benchmarks/bench_histogram.py [--numel N] [--dtype float32 ...] [--json FILE]
"""

from __future__ import annotations

import argparse

import torch

import zeroscan
from timing import best_per_call, describe_machine, dtype_name, fmt_time, progress, write_json
from zeroscan.testing import distributions_for, make_distribution

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def naive_histogram(x: torch.Tensor) -> list[torch.Tensor]:
    a = x.abs()
    finite = torch.isfinite(a)
    tiny = torch.finfo(x.dtype).tiny
    _, exp = torch.frexp(a[finite & (a >= tiny)].float())
    return [
        torch.bincount(exp.flatten().to(torch.int64) + 200),
        (x == 0).sum(),
        ((a > 0) & (a < tiny)).sum(),
        torch.isnan(x).sum(),
        torch.isinf(x).sum(),
    ]


def dtype_rows(dtype: torch.dtype, numel: int, budget: float, g: torch.Generator) -> list[dict[str, object]]:
    rows = []
    for name in distributions_for(dtype):
        progress(f"{dtype_name(dtype)} {name}")
        x = make_distribution(name, numel, dtype, g)
        floor = best_per_call(lambda: x.sum(), budget)
        plain = best_per_call(lambda: torch.ops.zeroscan.stats.default(x, None), budget)
        hist = best_per_call(lambda: torch.ops.zeroscan.stats_many_hist.default([x], None), budget)
        naive = best_per_call(lambda: naive_histogram(x), budget, batches=3)
        rows.append({"distribution": name, "floor": floor, "stats": plain, "hist": hist, "naive": naive})
        del x
    return rows


def print_table(dtype: torch.dtype, numel: int, rows: list[dict[str, object]]) -> None:
    print(f"\n### {dtype_name(dtype)}, {numel:,} elements: stats(x, histogram=True)\n")
    print("| distribution | x.sum() | stats / x.sum() | stats+hist / x.sum() | stats+hist / stats | naive / stats+hist |")
    print("|---|---|---|---|---|---|")
    worst = max(rows, key=lambda r: r["hist"] / r["floor"])  # type: ignore[operator]
    for r in rows + [dict(worst, distribution=f"**worst: {worst['distribution']}**")]:
        floor, plain, hist, naive = (float(r[k]) for k in ("floor", "stats", "hist", "naive"))  # type: ignore[arg-type]
        print(
            f"| {r['distribution']} | {fmt_time(floor)} | {plain / floor:.2f}× | {hist / floor:.2f}× "
            f"| {hist / plain:.2f}× | {naive / hist:.0f}× |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=64 << 20, help="elements per tensor (default 64M)")
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="only this dtype (repeatable)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per timing (default 1)")
    parser.add_argument("--json", help="also write the timings to this file")
    args = parser.parse_args()
    if args.numel <= 0:
        parser.error(f"--numel must be positive, got {args.numel}")
    g = torch.Generator().manual_seed(0)
    print(f"machine: {describe_machine()}")
    results = {}
    for name in args.dtype or ["float32", "bfloat16"]:
        rows = dtype_rows(DTYPES[name], args.numel, args.budget, g)
        print_table(DTYPES[name], args.numel, rows)
        results[name] = rows
    if args.json:
        write_json(args.json, {"machine": describe_machine(), "numel": args.numel, "results": results})


if __name__ == "__main__":
    main()
