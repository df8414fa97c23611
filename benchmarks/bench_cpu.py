"""CPU benchmark of zeroscan.stats against the baselines a user has today,
under every path of the CPU scan this machine has.

The scan runs one of several builds of its vector loop (AVX2, AVX-512; NEON
on Arm) or one element at a time; ZEROSCAN_CPU_CAPABILITY picks among them,
once per process, so each capability is measured in a process of its own:
by default native (the best build the CPU runs: AVX-512 where it has it) and
each narrower build it runs (`--caps` names others, scalar among them). The header says the CPU model and whether it
takes microcode assists on subnormal floating-point inputs (Intel cores do,
AMD cores do not): float32 x * 3 on subnormal x against normal x.

Within one capability, everything is timed in ONE process and reported as
ratios to baselines measured in that process:
  floor   x.sum() on a randn tensor: one read of memory. For 1-byte dtypes
          torch's own sum is no floor (float8 has none; int8 accumulates into
          int64 at well under a GB/s), so the floor is the same bytes read as
          float32: x.view(torch.float32).sum()
  stats   zeroscan.stats(x) on every distribution of zeroscan.testing that
          exists for the dtype (dense, sparse, all zero, underflowed,
          non-finite, large mean), since the scan's work could depend on the
          values; the worst one is its figure of merit
  hist    zeroscan.stats(x, histogram=True), on every distribution, at the
          largest size only
  naive   (x==0).sum(), abs().min()/max(), mean(), std(), norm(),
          isnan().sum(), isinf().sum(), subnormal count, each .item()'d
  torch   torch.std_mean + torch.aminmax + torch.count_nonzero
          (the fewest torch calls; still no NaN/Inf/subnormal counts)
Each cell's stats (and hist) calls are timed in turn with the floor's, one
call each at a time where a call takes a millisecond or more
(timing.best_in_turn): both then see the same moments of a machine whose
speed drifts, and read a 64M-element tensor from memory, not from a
last-level cache that can hold most of it (480 MB on the development VM).
naive and torch are timed on the worst distribution only, to bound the run.
One table per dtype (float32, bfloat16, float16, float8_e4m3fn, int8), rows
1K .. 64M elements; then hot loops: a field read after a 1K scan vs
x.sum().item(), stats_many over 200 tensors of 4K elements vs 200 calls,
quiet and with a busy process beside it. Last, the worst cell of each
capability at the largest size against the targets in benchmarks/README.md.

    python benchmarks/bench_cpu.py            # 1K .. 64M elements, every capability, ~8 minutes each on 2 cores
    python benchmarks/bench_cpu.py --quick    # up to 8M, shorter timing
    python benchmarks/bench_cpu.py --caps avx2,scalar --dtype float32
    python benchmarks/bench_cpu.py --json out.json

Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import zeroscan
from timing import best_in_turn, best_per_call, describe_machine, dtype_name, fmt_time, progress, write_json
from zeroscan.testing import distributions_for, make_distribution

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8)
SIZES = (1 << 10, 1 << 15, 1 << 20, 1 << 23, 1 << 26)
HUGE = 1 << 26  # the naive composite takes ~1.5 s a call here: few repeats
# The targets of the CPU scan at the largest size, worst distribution:
# stats / floor and stats(x, histogram=True) / floor (benchmarks/README.md).
TARGETS = {"float32": (1.25, 1.5), "bfloat16": (1.5, 2.0), "float16": (1.5, 2.0)}
# ZEROSCAN_CPU_CAPABILITY values, best first, and the /proc/cpuinfo flags each needs.
CAPABILITY_FLAGS = {
    "native": (),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi2"),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "scalar": (),
}


def works(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class Support:
    """What torch's reductions can do with a dtype on a device (the CPU unless
    given), probed on a tiny tensor."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        probe = torch.zeros(4, dtype=dtype, device=device)
        self.bytewise = probe.element_size() == 1  # floor: the bytes summed as float32
        self.sum = works(lambda: probe.sum())
        # comparisons, abs().min()/max(), aminmax, count_nonzero, isnan/isinf on x itself
        self.compare = works(
            lambda: (
                probe.abs().min(),
                torch.aminmax(probe),
                torch.count_nonzero(probe),
                (probe == 0).sum(),
                (probe.abs() > 0) & (probe.abs() < 1),
                torch.isnan(probe).sum(),
                torch.isinf(probe).sum(),
            )
        )
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
    m = y if support.moments and y.is_floating_point() else y.float()  # integers: moments of x.float()
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
    m = y if support.moments and y.is_floating_point() else y.float()  # integers: moments of x.float()
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
    hist_ratio: dict[str, float] = {}
    for n in sizes:
        floor_s: dict[str, float] = {}
        stats_s: dict[str, float] = {}
        hist_s: dict[str, float] = {}
        ratio: dict[str, float] = {}
        worst_name, worst_x = "", None
        floor = floor_fn(make_distribution("randn", n, dtype, g), support)
        for i, dist in enumerate(dists, 1):
            progress(f"{name} {n:,}: {dist} ({i}/{len(dists)})")
            x = make_distribution(dist, n, dtype, g)
            # The floor is timed in turn with each cell (timing.best_in_turn).
            fns = [floor, lambda: zeroscan.stats(x)]
            if n == sizes[-1]:
                fns.append(lambda: zeroscan.stats(x, histogram=True))
            times = best_in_turn(fns, budget * (len(fns) - 1))
            floor_s[dist], stats_s[dist] = times[0], times[1]
            if len(times) > 2:
                hist_s[dist] = times[2]
            ratio[dist] = stats_s[dist] / floor_s[dist]
            if worst_x is None or ratio[dist] > ratio[worst_name]:
                worst_name, worst_x = dist, x
            del x  # at most the worst tensor and the current one stay alive
        assert worst_x is not None
        sum_s = min(floor_s.values())
        progress(f"{name} {n:,}: naive and torch 3-call on {worst_name}")
        batches = 2 if n >= HUGE else 5
        naive_s = best_per_call(lambda: naive(worst_x, support), budget, batches)
        torch_s = best_per_call(lambda: fused_torch(worst_x, support), budget, batches)
        del worst_x
        hist_ratio = {d: t / floor_s[d] for d, t in hist_s.items()} or hist_ratio
        worst_s = stats_s[worst_name]
        row = {
            "numel": n,
            "sum_s": sum_s,
            "floor_s": floor_s,
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
    if hist_ratio:
        worst_hist = max(hist_ratio, key=hist_ratio.__getitem__)
        cells = ", ".join(f"{d} {r:.2f}×" for d, r in hist_ratio.items())
        print(f"stats(x, histogram=True) / floor at {sizes[-1]:,}: worst {hist_ratio[worst_hist]:.2f}× {worst_hist} ({cells})")
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
        "hist_ratio": hist_ratio,
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
    # Each call is timed in turn with its baseline (timing.best_in_turn), as
    # the dtype tables are: timed one after the other, a ratio took the
    # machine's drift between them (0.24-0.41 for one build's stats_many).
    t: dict[str, float] = {}

    def in_turn(key: str, fn: Callable[[], object], base_key: str, base: Callable[[], object]) -> None:
        t[key], t[base_key] = best_in_turn([fn, base], 2 * budget)

    in_turn("read_1k_s", lambda: zeroscan.stats(x).zeros, "sum_item_1k_s", lambda: x.sum().item())
    in_turn("many_read_s", lambda: [s.zeros for s in zeroscan.stats_many(xs)],
            "loop_read_s", lambda: [zeroscan.stats(y).zeros for y in xs])
    in_turn("many_s", lambda: zeroscan.stats_many(xs), "loop_s", lambda: [zeroscan.stats(y) for y in xs])
    # The same with another process spinning beside it, as a training run's
    # data loaders do: a parallel region would wait for its descheduled thread.
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        in_turn("busy_many_s", lambda: zeroscan.stats_many(xs), "busy_loop_s", lambda: [zeroscan.stats(y) for y in xs])
    finally:
        busy.kill()
        busy.wait()
    print("### Hot loops, float32")
    print()
    print("| call | time | baseline | baseline time | ratio |")
    print("|---|---|---|---|---|")
    rows = (
        ("`stats(x).zeros`, 1K", "read_1k_s", "`x.sum().item()`", "sum_item_1k_s"),
        ("`[s.zeros for s in stats_many(xs)]`, 200 × 4K", "many_read_s", "200 × `stats(x).zeros`", "loop_read_s"),
        ("`stats_many(xs)`, no reads, 200 × 4K", "many_s", "200 × `stats(x)`", "loop_s"),
        ("the same, a busy process beside it", "busy_many_s", "200 × `stats(x)`, busy", "busy_loop_s"),
    )
    for call, key, base, base_key in rows:
        print(f"| {call} | {fmt_time(t[key])} | {base} | {fmt_time(t[base_key])} | {t[key] / t[base_key]:.2f}× |")
    print(flush=True)
    return t


def run(quick: bool, dtypes: tuple[torch.dtype, ...] = DTYPES) -> dict[str, object]:
    """Every table under the capability this process runs."""
    sizes = [n for n in SIZES if not (quick and n >= HUGE)]
    budget = 0.2 if quick else 1.0
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    cap = os.environ.get("ZEROSCAN_CPU_CAPABILITY", "native")
    print(f"## ZEROSCAN_CPU_CAPABILITY={cap}")
    print()
    print(
        "Cells are zeroscan.stats(x) time / floor time (one read of a randn tensor of the same size), "
        "the two timed in turn, the best of each taken; the floor column is the fastest floor of the row."
    )
    print(f"Load average (1 min) at the start: {load_before:.2f}; anything else running moves these timings.")
    print()
    tables = [dtype_table(dtype, sizes, budget, g) for dtype in dtypes]
    loops = hot_loops(budget)
    elapsed = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    print(f"Load average (1 min) at the end: {load_after:.2f}; {cap} took {elapsed:.0f} s.")
    print(flush=True)
    progress(f"{cap} done in {elapsed:.0f} s")
    return {
        "capability": cap,
        "quick": quick,
        "load_before": load_before,
        "load_after": load_after,
        "tables": tables,
        "hot_loops": loops,
        "elapsed_s": elapsed,
    }


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def capabilities_here() -> list[str]:
    """native (the best build the CPU runs), then each narrower build it runs
    (scalar only when asked)."""
    flags = cpu_flags()
    builds = [cap for cap, needs in CAPABILITY_FLAGS.items() if needs and set(needs) <= flags]
    return ["native"] + builds[1:]  # builds[0] is what native runs


def subnormal_assists() -> float:
    """How much longer float32 x * 3 takes on subnormal x than on normal x:
    about 1 on CPUs without microcode assists, far more on those with."""
    normal = torch.full((1 << 20,), 1.5)
    tiny = torch.full((1 << 20,), 1e-40)
    out = torch.empty_like(normal)
    t_normal = best_per_call(lambda: torch.mul(normal, 3.0, out=out), 0.2)
    t_tiny = best_per_call(lambda: torch.mul(tiny, 3.0, out=out), 0.2)
    return t_tiny / t_normal


def summary(results: list[dict[str, object]]) -> None:
    """The worst cell of each capability at the largest size, against the targets."""
    print("## Worst distribution at the largest size, per capability")
    print()
    print("| capability | dtype | stats / floor | target | hist / floor | target |")
    print("|---|---|---|---|---|---|")
    for result in results:
        for table in result["tables"]:  # type: ignore[union-attr]
            row = table["rows"][-1]
            name = table["dtype"]
            stats_target, hist_target = TARGETS.get(name, (None, None))
            hist = table["hist_ratio"]
            worst_hist = max(hist, key=hist.__getitem__) if hist else None

            def cell(value: float, label: str, target: float | None) -> str:
                mark = "" if target is None else (" ✓" if value <= target else " ✗")
                return f"{value:.2f}× {label}{mark}"

            hist_cell = cell(hist[worst_hist], worst_hist, hist_target) if worst_hist else "—"
            print(
                f"| {result['capability']} | {name} | {cell(row['worst_ratio'], row['worst'], stats_target)} | "
                f"{'—' if stats_target is None else f'≤ {stats_target}×'} | {hist_cell} | "
                f"{'—' if hist_target is None else f'≤ {hist_target}×'} |"
            )
    print()
    print("| capability | `stats(x).zeros`, 1K / `x.sum().item()` | `stats_many` 200 × 4K / 200 `stats`, quiet | the same, busy |")
    print("|---|---|---|---|")
    for result in results:
        t = result["hot_loops"]
        print(
            f"| {result['capability']} | {t['read_1k_s'] / t['sum_item_1k_s']:.2f}× (≤ 3×) | "  # type: ignore[index]
            f"{t['many_s'] / t['loop_s']:.2f}× | {t['busy_many_s'] / t['busy_loop_s']:.2f}× (≤ 0.25×) |"  # type: ignore[index]
        )
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes up to 8M, shorter timing")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    names = [dtype_name(d) for d in DTYPES]
    parser.add_argument("--dtype", action="append", choices=names, help="only this dtype (repeatable); default: all")
    parser.add_argument(
        "--caps", help="comma-separated ZEROSCAN_CPU_CAPABILITY values (native, avx512, avx2, scalar); "
        "default: every one this CPU has but scalar"
    )
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # one capability, this process
    args = parser.parse_args()
    dtypes = tuple(getattr(torch, name) for name in args.dtype) if args.dtype else DTYPES
    if args.in_process:
        write_json(args.json, run(args.quick, dtypes))
        return
    caps = args.caps.split(",") if args.caps else capabilities_here()
    unknown = [cap for cap in caps if cap not in CAPABILITY_FLAGS]
    if unknown:
        parser.error(f"--caps: unknown capability {unknown[0]!r}; choose from {', '.join(CAPABILITY_FLAGS)}")
    assists = subnormal_assists()
    print(f"# zeroscan CPU benchmark — {describe_machine()}")
    print()
    takes = "takes microcode assists on" if assists > 1.5 else "takes no microcode assists on"
    print(f"This CPU {takes} subnormal float32 inputs: x * 3 is {assists:.1f}× slower on subnormal x than on normal x.")
    print(f"Capabilities measured, each in a process of its own: {', '.join(caps)}.")
    print(flush=True)
    results = []
    for cap in caps:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--in-process", "--json", out.name] + (["--quick"] if args.quick else [])
            for name in args.dtype or []:
                command += ["--dtype", name]
            env = {**os.environ, "ZEROSCAN_CPU_CAPABILITY": cap}
            subprocess.run(command, env=env, check=True)  # its tables go straight to stdout
            with open(out.name) as f:
                results.append(json.load(f))
    summary(results)
    write_json(args.json, {"machine": describe_machine(), "subnormal_assists": assists, "capabilities": results})


if __name__ == "__main__":
    main()
