"""CPU benchmark of zeroscan.stats against the baselines a user has today.

Everything is timed in ONE run on the same tensors, and reported as ratios:
  floor   x.sum()                                   one read of memory
  naive   (x==0).sum(), abs().min()/max(), mean(), std(), norm(),
          isnan().sum(), isinf().sum(), subnormal count, each .item()'d
  torch   torch.std_mean + torch.aminmax + torch.count_nonzero
          (the fewest torch calls; still no NaN/Inf/subnormal counts)
and stats_many over 200 tensors of 4K elements against 200 stats() calls.

    python benchmarks/bench_cpu.py            # full table, 1K .. 64M elements
    python benchmarks/bench_cpu.py --quick    # smaller sizes, fewer repeats
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch

import zeroscan


def per_call_seconds(fn: Callable[[], object], budget: float) -> float:
    """Best per-call time over several batches sized to last ~budget/5 each."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(budget / 5 / once))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def naive(x: torch.Tensor) -> list[float]:
    tiny = torch.finfo(x.dtype).tiny
    a = x.abs()
    return [
        (x == 0).sum().item(),
        a.min().item(),
        a.max().item(),
        x.mean().item(),
        x.std().item(),
        x.norm().item(),
        torch.isnan(x).sum().item(),
        torch.isinf(x).sum().item(),
        ((a > 0) & (a < tiny)).sum().item(),
    ]


def fused_torch(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    std, mean = torch.std_mean(x)
    lo, hi = torch.aminmax(x)
    return std, mean, lo, hi, torch.count_nonzero(x)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"


def run(quick: bool) -> dict[str, object]:
    sizes = [1 << 10, 1 << 15, 1 << 20, 1 << 23] + ([] if quick else [1 << 26])
    budget = 0.3 if quick else 1.0
    rows = []
    print(f"# zeroscan CPU benchmark — {machine()}")
    print()
    print("| dtype | numel | x.sum() | stats() | stats/sum | stats+read | naive | naive/stats | torch 3-call | torch/stats |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x = torch.randn(n).to(dtype)
            t_sum = per_call_seconds(lambda: x.sum(), budget)
            t_stats = per_call_seconds(lambda: zeroscan.stats(x), budget)
            t_read = per_call_seconds(lambda: zeroscan.stats(x).zeros, budget)
            t_naive = per_call_seconds(lambda: naive(x), budget if n < 1 << 24 else 3 * budget)
            t_torch = per_call_seconds(lambda: fused_torch(x), budget)
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "numel": n,
                "sum_s": t_sum,
                "stats_s": t_stats,
                "stats_read_s": t_read,
                "naive_s": t_naive,
                "torch_s": t_torch,
            }
            rows.append(row)
            print(
                f"| {row['dtype']} | {n:,} | {fmt_time(t_sum)} | {fmt_time(t_stats)} | "
                f"{t_stats / t_sum:.2f}× | {fmt_time(t_read)} | {fmt_time(t_naive)} | "
                f"{t_naive / t_stats:.0f}× | {fmt_time(t_torch)} | {t_torch / t_stats:.1f}× |",
                flush=True,
            )

    xs = [torch.randn(4096) for _ in range(200)]
    t_many = per_call_seconds(lambda: zeroscan.stats_many(xs), budget)
    t_loop = per_call_seconds(lambda: [zeroscan.stats(x) for x in xs], budget)
    print()
    print("| 200 tensors × 4K float32 | time | ratio |")
    print("|---|---|---|")
    print(f"| 200 × stats() | {fmt_time(t_loop)} | 1.00 |")
    print(f"| stats_many() | {fmt_time(t_many)} | {t_many / t_loop:.2f}× |")
    return {"machine": machine(), "rows": rows, "many_s": t_many, "loop_s": t_loop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes up to 8M, shorter timing")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    results = run(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
