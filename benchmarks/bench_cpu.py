"""CPU benchmark of zeroscan.stats against the baselines a user has today.

Everything is timed in ONE run and reported as ratios to baselines measured in
that run:
  floor   x.sum() on the randn tensor: one read of memory. For 1-byte dtypes
          torch's own sum is no floor (float8 has none; int8 accumulates into
          int64 at well under a GB/s), so the floor is the same bytes read as
          float32: x.view(torch.float32).sum()
  stats   zeroscan.stats(x) on every distribution of zeroscan.testing that
          exists for the dtype (dense, sparse, all zero, underflowed,
          non-finite, large mean), since the scan's work could depend on the
          values; the worst one is its figure of merit
  naive   (x==0).sum(), abs().min()/max(), mean(), std(), norm(),
          isnan().sum(), isinf().sum(), subnormal count, each .item()'d
  torch   torch.std_mean + torch.aminmax + torch.count_nonzero
          (the fewest torch calls; still no NaN/Inf/subnormal counts)
naive and torch are timed on the worst distribution only, to bound the run.
One table per dtype (float32, bfloat16, float16, float8_e4m3fn, int8), rows
1K .. 64M elements; then hot loops: a field read after a 1K scan vs
x.sum().item(), and stats_many over 200 tensors of 4K elements vs 200 calls.

    python benchmarks/bench_cpu.py            # 1K .. 64M elements, about 6-7 minutes on 2 cores
    python benchmarks/bench_cpu.py --quick    # up to 8M, shorter timing, ~1 minute
    python benchmarks/bench_cpu.py --json out.json

Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

import zeroscan
from timing import best_per_call, describe_machine, dtype_name, fmt_time, progress, write_json
from zeroscan.testing import distributions_for, make_distribution

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8)
SIZES = (1 << 10, 1 << 15, 1 << 20, 1 << 23, 1 << 26)
HUGE = 1 << 26  # the naive composite takes ~1.5 s a call here: few repeats


def works(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class Support:
    """What torch's CPU reductions can do with a dtype, probed on a tiny tensor."""

    def __init__(self, dtype: torch.dtype) -> None:
        probe = torch.zeros(4, dtype=dtype)
        self.bytewise = probe.element_size() == 1  # floor: the bytes summed as float32
        self.sum = works(lambda: probe.sum())
        # comparisons, abs().min()/max(), aminmax, count_nonzero on x itself
        self.compare = works(lambda: (probe.abs().min(), torch.aminmax(probe), torch.count_nonzero(probe)))
        # mean/std/norm and std_mean
        self.moments = works(lambda: (probe.mean(), probe.std(), probe.norm(), torch.std_mean(probe)))

    def floor_label(self) -> str:
        return "x.view(torch.float32).sum()" if self.bytewise else "x.sum()"

    def composite_note(self, dtype: torch.dtype) -> str:
        name = dtype_name(dtype)
        if not self.compare:
            return (
                f"torch has no CPU abs().min()/aminmax/mean/std for {name}: naive and torch 3-call "
                "run on x.float(), the conversion timed with them"
            )
        if not self.moments:
            return (
                "mean/std/norm and std_mean need a floating input: naive and torch 3-call take them "
                "of x.float(), the conversion timed with them"
            )
        return ""


def floor_fn(x: torch.Tensor, support: Support) -> Callable[[], object]:
    if not support.bytewise:
        return lambda: x.sum()
    raw = x.view(torch.float32)  # every size here is a multiple of 4 bytes
    return lambda: raw.sum()


def naive(x: torch.Tensor, support: Support) -> list[float]:
    dtype = x.dtype
    y = x if support.compare else x.float()
    m = y if y.is_floating_point() else y.float()  # integers: moments of x.float()
    a = y.abs()
    out = [
        (y == 0).sum().item(),
        a.min().item(),
        a.max().item(),
        m.mean().item(),
        m.std().item(),
        m.norm().item(),
    ]
    if dtype.is_floating_point:  # integers have no NaN, Inf or subnormals to count
        tiny = torch.finfo(dtype).tiny
        out += [torch.isnan(y).sum().item(), torch.isinf(y).sum().item(), ((a > 0) & (a < tiny)).sum().item()]
    return out


def fused_torch(x: torch.Tensor, support: Support) -> tuple[torch.Tensor, ...]:
    y = x if support.compare else x.float()
    m = y if y.is_floating_point() else y.float()  # integers: moments of x.float()
    std, mean = torch.std_mean(m)
    lo, hi = torch.aminmax(y)
    return std, mean, lo, hi, torch.count_nonzero(y)


def dtype_table(dtype: torch.dtype, sizes: list[int], budget: float, g: torch.Generator) -> dict[str, object]:
    """One dtype: the floor, stats on every distribution, naive and torch on the worst."""
    name = dtype_name(dtype)
    dists = distributions_for(dtype)
    support = Support(dtype)
    rows = []
    print(f"### {name}: stats() / {support.floor_label()}, by distribution")
    print()
    print("| numel | " + " | ".join(dists) + " | worst | floor | naive / stats | torch 3-call / stats |")
    print("|---|" + "---|" * (len(dists) + 4))
    for n in sizes:
        stats_s: dict[str, float] = {}
        worst_name, worst_x = "", None
        sum_s = 0.0
        for i, dist in enumerate(dists, 1):
            progress(f"{name} {n:,}: {dist} ({i}/{len(dists)})")
            x = make_distribution(dist, n, dtype, g)
            if dist == "randn":
                sum_s = best_per_call(floor_fn(x, support), budget)
            stats_s[dist] = best_per_call(lambda: zeroscan.stats(x), budget)
            if worst_x is None or stats_s[dist] > stats_s[worst_name]:
                worst_name, worst_x = dist, x
            del x  # at most the worst tensor and the current one stay alive
        assert worst_x is not None
        progress(f"{name} {n:,}: naive and torch 3-call on {worst_name}")
        batches = 2 if n >= HUGE else 5
        naive_s = best_per_call(lambda: naive(worst_x, support), budget, batches)
        torch_s = best_per_call(lambda: fused_torch(worst_x, support), budget, batches)
        del worst_x
        ratio = {d: t / sum_s for d, t in stats_s.items()}
        worst_s = stats_s[worst_name]
        row = {
            "numel": n,
            "sum_s": sum_s,
            "stats_s": stats_s,
            "ratio": ratio,
            "worst": worst_name,
            "worst_ratio": ratio[worst_name],
            "naive_s": naive_s,
            "torch_s": torch_s,
            "naive_over_stats": naive_s / worst_s,
            "torch_over_stats": torch_s / worst_s,
        }
        rows.append(row)
        cells = " | ".join(f"{ratio[d]:.2f}×" for d in dists)
        print(
            f"| {n:,} | {cells} | {ratio[worst_name]:.2f}× {worst_name} | {fmt_time(sum_s)} | "
            f"{naive_s / worst_s:.0f}× | {torch_s / worst_s:.1f}× |",
            flush=True,
        )
    print()
    notes = []
    if support.bytewise:
        own = "has no CPU sum" if not support.sum else "sums it into int64, far below memory speed"
        notes.append(
            f"torch {own} for {name}: the floor is x.view(torch.float32).sum(), which reads the same bytes"
        )
    if support.composite_note(dtype):
        notes.append(support.composite_note(dtype))
    notes.append("naive and torch 3-call are timed on the worst distribution of their row")
    for note in notes:
        print(f"- {note}.")
    print(flush=True)
    return {
        "dtype": name,
        "floor": support.floor_label(),
        "distributions": list(dists),
        "notes": notes,
        "rows": rows,
    }


def hot_loops(budget: float) -> dict[str, float]:
    """A field read right after a small scan, and many small tensors."""
    progress("hot loops")
    x = torch.randn(1 << 10)
    xs = [torch.randn(4096) for _ in range(200)]
    t = {
        "read_1k_s": best_per_call(lambda: zeroscan.stats(x).zeros, budget),
        "sum_item_1k_s": best_per_call(lambda: x.sum().item(), budget),
        "many_read_s": best_per_call(lambda: [s.zeros for s in zeroscan.stats_many(xs)], budget),
        "loop_read_s": best_per_call(lambda: [zeroscan.stats(y).zeros for y in xs], budget),
        "many_s": best_per_call(lambda: zeroscan.stats_many(xs), budget),
        "loop_s": best_per_call(lambda: [zeroscan.stats(y) for y in xs], budget),
    }
    print("### Hot loops, float32")
    print()
    print("| call | time | baseline | baseline time | ratio |")
    print("|---|---|---|---|---|")
    rows = (
        ("`stats(x).zeros`, 1K", "read_1k_s", "`x.sum().item()`", "sum_item_1k_s"),
        ("`[s.zeros for s in stats_many(xs)]`, 200 × 4K", "many_read_s", "200 × `stats(x).zeros`", "loop_read_s"),
        ("`stats_many(xs)`, no reads, 200 × 4K", "many_s", "200 × `stats(x)`", "loop_s"),
    )
    for call, key, base, base_key in rows:
        print(f"| {call} | {fmt_time(t[key])} | {base} | {fmt_time(t[base_key])} | {t[key] / t[base_key]:.2f}× |")
    print(flush=True)
    return t


def run(quick: bool, dtypes: tuple[torch.dtype, ...] = DTYPES) -> dict[str, object]:
    sizes = [n for n in SIZES if not (quick and n >= HUGE)]
    budget = 0.2 if quick else 1.0
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    print(f"# zeroscan CPU benchmark — {describe_machine()}")
    print()
    print("Cells are zeroscan.stats(x) time / floor time (one read of the randn tensor); best of five batches each.")
    print(f"Load average (1 min) at the start: {load_before:.2f}; anything else running moves these timings.")
    print()
    tables = [dtype_table(dtype, sizes, budget, g) for dtype in dtypes]
    loops = hot_loops(budget)
    elapsed = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    print(f"Load average (1 min) at the end: {load_after:.2f}; run took {elapsed:.0f} s.")
    progress(f"done in {elapsed:.0f} s")
    return {
        "machine": describe_machine(),
        "quick": quick,
        "load_before": load_before,
        "load_after": load_after,
        "tables": tables,
        "hot_loops": loops,
        "elapsed_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes up to 8M, shorter timing")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    names = [dtype_name(d) for d in DTYPES]
    parser.add_argument("--dtype", action="append", choices=names, help="only this dtype (repeatable); default: all")
    args = parser.parse_args()
    dtypes = tuple(getattr(torch, name) for name in args.dtype) if args.dtype else DTYPES
    results = run(args.quick, dtypes)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
