"""GPU benchmark of zeroscan against what the device allows, in ONE run.

Every figure is a ratio to a baseline timed in the same run on the same
device. Times are the median of 7 batches of back-to-back calls, each batch
timed between two device synchronisations and long enough that they are noise.

1. bandwidth   stats(x) and stats(x, histogram=True) on float32, bfloat16,
               float16 and float8_e4m3fn (--dtypes)
               tensors of 256 MB, 1 GB and 4 GB, for every value distribution
               of zeroscan.testing (dense, 50 % / 99 % / all zeros, all and
               0.1 % subnormal, 0.01 % / 1 % NaN and Inf, large mean), as read
               GB/s over the GB/s of a device-to-device copy (bytes read plus
               written: what the memory sustains), and as a multiple of
               x.sum() (one read, torch's reduction; for 1-byte dtypes,
               x.view(torch.float32).sum()). The naive torch composite (10
               reductions, each read back to the host) is timed on the worst
               distribution. Targets: stats >= 90 % of the copy on every
               distribution (float8: >= 80 %), the histogram >= 85 %.
2. stats_many  over the parameter list of a Llama-style transformer (default
               7B in bfloat16, 13.5 GB) and over 2,000 small tensors
               (launch-bound), against stats() of one flat tensor of the
               same bytes, a Python loop of stats(), and
               torch._foreach_norm (one statistic where zeroscan computes
               twelve). Target: <= 1.15 x flat, faster than _foreach_norm.
3. host syncs  per call of stats, stats_many and their histogram forms,
               counted under torch.cuda.set_sync_debug_mode("warn"), with a
               read of one field as the positive control. Target: 0.
4. graphs      CUDA-graph capture and replay of stats and stats_many: replay
               time against eager, and replayed rows equal to eager ones
               after the data changed in place.
5. training    cuda_training.py: the Monitor (every=1) on a >= 1B-parameter
               transformer training step: overhead, host syncs of the whole
               step, and the step captured in a CUDA graph.

    python benchmarks/bench_cuda.py --json out.json   # everything (~40 GB of GPU memory)
    python benchmarks/bench_cuda.py --quick           # up to 256 MB, 1B shapes, a small training step
    python benchmarks/bench_cuda.py --only syncs,graphs
    python benchmarks/bench_cuda.py --sizes 1024 --only bandwidth   # the bandwidth table at 1 GB alone
    python benchmarks/bench_cuda.py --sizes 1024 --only bandwidth --dtypes float16
    python benchmarks/bench_cuda.py --device cpu --smoke   # tiny sizes: checks the code paths without a GPU

The summary table printed last holds the figures the targets are judged on.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch

import zeroscan
from bench_cpu import Support, floor_fn, naive
from cuda_training import training_tables
from timing import count_syncs, describe_machine, device_sync, dtype_name, fmt_time, free_memory, progress, time_batches, write_json
from zeroscan.ops import FLOAT_DTYPES
from zeroscan.testing import distributions_for, make_distribution

MB = 1 << 20
BLOCK = 1 << 24  # values drawn on the host per distribution, then tiled on the device (host draws are slow)
SECTIONS = ("bandwidth", "many", "syncs", "graphs", "training")
BANDWIDTH_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
# The bandwidth targets: stats, and stats(histogram=True), as a share of the copy's GB/s.
STATS_TARGET = {"float8_e4m3fn": 0.80, "float8_e5m2": 0.80}  # other dtypes: 0.90
HISTOGRAM_TARGET = 0.85

# Llama-style decoder shapes: hidden size, layers, MLP width, vocabulary.
MODELS = {
    "tiny": (64, 2, 176, 1000),
    "1b": (2048, 22, 5632, 32000),
    "3b": (3200, 26, 8640, 32000),
    "7b": (4096, 32, 11008, 32000),
}


class Plan:
    """What one run measures, by mode: full (the quoted run), quick (a shorter
    GPU run) or smoke (tiny, on any device: the code paths only)."""

    def __init__(
        self,
        mode: str,
        device: torch.device,
        model: str | None,
        model_dtype: torch.dtype,
        sizes_mb: list[int] | None = None,
        dtypes: tuple[torch.dtype, ...] = tuple(getattr(torch, d) for d in BANDWIDTH_DTYPES),
    ) -> None:
        self.mode = mode
        self.dtypes = dtypes
        self.device = device
        default_sizes = {"full": [256 * MB, 1024 * MB, 4096 * MB], "quick": [64 * MB, 256 * MB], "smoke": [MB, 4 * MB]}[mode]
        self.sizes = [mb * MB for mb in sizes_mb] if sizes_mb else default_sizes
        self.budget = {"full": 0.5, "quick": 0.3, "smoke": 0.02}[mode]
        self.model = model or {"full": "7b", "quick": "1b", "smoke": "tiny"}[mode]
        self.model_dtype = model_dtype
        self.small_tensors = 200 if mode == "smoke" else 2000
        self.training = {"full": "1b", "quick": "small", "smoke": "smoke"}[mode]

    def seconds(self, fn: Callable[[], object]) -> float:
        """Median seconds per call over 7 batches, each about budget / 7 long."""
        sync = device_sync(self.device)
        return statistics.median(time_batches(fn, 7, batch_seconds=self.budget / 7, sync=sync))


def fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):.0f} GB" if n >= 1 << 30 else f"{n / MB:.0f} MB"


def on_device(name: str, numel: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """numel values of distribution `name` on `device`: one host-drawn block of
    up to BLOCK values (larger than any L2), tiled."""
    block = make_distribution(name, min(numel, BLOCK), dtype, g).to(device)
    if block.numel() == numel:
        return block
    # Tiled as bytes: the same bits, and no float8 kernel needed.
    raw = block.view(torch.uint8)
    return raw.repeat(math.ceil(numel / block.numel()))[: numel * block.element_size()].view(dtype)





# ---------------------------------------------------------------- 1. bandwidth


def bandwidth_tables(plan: Plan, g: torch.Generator) -> list[dict[str, object]]:
    return [dtype_bandwidth(plan, dtype, g) for dtype in plan.dtypes]


def dtype_bandwidth(plan: Plan, dtype: torch.dtype, g: torch.Generator) -> dict[str, object]:
    name = dtype_name(dtype)
    item = torch.empty((), dtype=dtype).element_size()
    counts = [size // item for size in plan.sizes]
    dists = distributions_for(dtype)
    support = Support(dtype, plan.device)  # what the device's torch can do with dtype
    copy_s, sum_s, stats_s, hist_s = time_distributions(plan, dtype, support, counts, g)
    naive_s, worst = naive_on_worst(plan, dtype, support, counts, stats_s, g)
    rows = []
    for size, n in zip(plan.sizes, counts):
        copy_gbps = 2 * size / copy_s[n] / 1e9
        rows.append(
            {
                "bytes": size,
                "copy_GBps": copy_gbps,
                "sum_GBps": size / sum_s[n] / 1e9,
                "stats_of_copy": {d: size / t / 1e9 / copy_gbps for d, t in stats_s[n].items()},
                "stats_over_sum": {d: t / sum_s[n] for d, t in stats_s[n].items()},
                "histogram_of_copy": {d: size / t / 1e9 / copy_gbps for d, t in hist_s[n].items()},
                "histogram_over_stats": {d: hist_s[n][d] / stats_s[n][d] for d in dists},
                "worst": worst[n],
                "naive_over_stats": naive_s[n] / stats_s[n][worst[n]],
                "copy_s": copy_s[n],
                "sum_s": sum_s[n],
                "stats_s": stats_s[n],
                "histogram_s": hist_s[n],
                "naive_s": naive_s[n],
            }
        )
    print_bandwidth(name, support.floor_label(), plan.sizes, dists, rows)
    free_memory()
    return {"dtype": name, "distributions": list(dists), "rows": rows}


Seconds = dict[int, float]  # numel -> seconds per call


def time_distributions(
    plan: Plan, dtype: torch.dtype, support: Support, counts: list[int], g: torch.Generator
) -> tuple[Seconds, Seconds, dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """Seconds per call of the copy and the floor (x.sum(), or a 1-byte dtype's
    bytes summed as float32) on dense data, and of stats and
    stats(histogram=True) on every distribution, at each numel."""
    name = dtype_name(dtype)
    dists = distributions_for(dtype)
    sink = torch.empty(max(counts), dtype=dtype, device=plan.device)  # the copy's destination
    copy_s: Seconds = {}
    sum_s: Seconds = {}
    stats_s: dict[int, dict[str, float]] = {n: {} for n in counts}
    hist_s: dict[int, dict[str, float]] = {n: {} for n in counts}
    for i, dist in enumerate(dists, 1):
        progress(f"bandwidth {name}: {dist} ({i}/{len(dists)})")
        full = on_device(dist, max(counts), dtype, plan.device, g)
        for n in counts:
            x = full[:n]
            if dist == "randn":
                copy_s[n] = plan.seconds(lambda: sink[:n].copy_(x))
                sum_s[n] = plan.seconds(floor_fn(x, support))
            stats_s[n][dist] = plan.seconds(lambda: zeroscan.stats(x))
            hist_s[n][dist] = plan.seconds(lambda: zeroscan.stats(x, histogram=True))
    return copy_s, sum_s, stats_s, hist_s


def naive_on_worst(
    plan: Plan,
    dtype: torch.dtype,
    support: Support,
    counts: list[int],
    stats_s: dict[int, dict[str, float]],
    g: torch.Generator,
) -> tuple[dict[int, float], dict[int, str]]:
    """The naive composite's seconds on each size's slowest distribution (drawn again)."""
    worst = {n: max(stats_s[n], key=lambda d: stats_s[n][d]) for n in counts}
    naive_s: dict[int, float] = {}
    for dist in sorted(set(worst.values())):
        progress(f"bandwidth {dtype_name(dtype)}: naive composite on {dist}")
        full = on_device(dist, max(counts), dtype, plan.device, g)
        for n in counts:
            if worst[n] == dist:
                x = full[:n]
                naive_s[n] = plan.seconds(lambda: naive(x, support))
        del full
    return naive_s, worst


def print_bandwidth(name: str, floor: str, sizes: list[int], dists: tuple[str, ...], rows: list[dict[str, object]]) -> None:
    head = " | ".join(fmt_bytes(s) for s in sizes)
    rule = "|---|" + "---|" * len(sizes)
    print(f"### {name}: stats(x) read GB/s as % of a device-to-device copy's GB/s (× {floor} time)")
    print()
    print(f"| distribution | {head} |")
    print(rule)
    print("| copy GB/s (read + written) | " + " | ".join(f"{r['copy_GBps']:.0f}" for r in rows) + " |")
    print(f"| {floor} | " + " | ".join(f"{r['sum_GBps'] / r['copy_GBps']:.0%}" for r in rows) + " |")
    for d in dists:
        cells = " | ".join(f"{r['stats_of_copy'][d]:.0%} ({r['stats_over_sum'][d]:.2f}×)" for r in rows)
        print(f"| {d} | {cells} |")
    print("| **worst** | " + " | ".join(f"**{r['stats_of_copy'][r['worst']]:.0%}** {r['worst']}" for r in rows) + " |")
    print("| naive composite / stats, worst | " + " | ".join(f"{r['naive_over_stats']:.0f}×" for r in rows) + " |")
    print()
    print(f"### {name}: stats(x, histogram=True) as % of the copy's GB/s (× stats(x) time)")
    print()
    print(f"| distribution | {head} |")
    print(rule)
    for d in dists:
        cells = " | ".join(f"{r['histogram_of_copy'][d]:.0%} ({r['histogram_over_stats'][d]:.2f}×)" for r in rows)
        print(f"| {d} | {cells} |")
    print(flush=True)


# ---------------------------------------------------------------- 2. stats_many


def transformer_shapes(model: str) -> list[tuple[int, ...]]:
    hidden, layers, mlp, vocab = MODELS[model]
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4  # q, k, v, o
        shapes += [(mlp, hidden), (mlp, hidden), (hidden, mlp)]  # gate, up, down
        shapes += [(hidden,), (hidden,)]  # the two norms
    return shapes + [(hidden,), (vocab, hidden)]  # final norm, lm_head


def small_shapes(count: int, g: torch.Generator) -> list[tuple[int, ...]]:
    """`count` 1-D sizes spread log-uniformly over 256 .. 64K elements."""
    logs = torch.rand(count, generator=g) * math.log(256) + math.log(256)
    return [(int(v),) for v in logs.exp()]


def many_tables(plan: Plan, g: torch.Generator) -> list[dict[str, object]]:
    out = []
    cases = [
        (f"{plan.model} model", transformer_shapes(plan.model)),
        (f"{plan.small_tensors:,} small tensors", small_shapes(plan.small_tensors, g)),
    ]
    for label, shapes in cases:
        progress(f"stats_many: {label}")
        out.append(many_table(plan, label, shapes))
    return out


def many_table(plan: Plan, label: str, shapes: list[tuple[int, ...]]) -> dict[str, object]:
    dtype, device = plan.model_dtype, plan.device
    params = [torch.randn(shape, device=device, dtype=dtype) for shape in shapes]
    numel = sum(p.numel() for p in params)
    size = numel * params[0].element_size()
    times = many_times(plan, params, torch.randn(numel, device=device, dtype=dtype))
    del params
    free_memory()
    flat_s = times["stats(flat): one tensor, same bytes"]
    print(f"| {label}: {len(shapes):,} tensors, {numel / 1e9:.3g}B × {dtype_name(dtype)} = {fmt_bytes(size)} | time | GB/s | / flat |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {fmt_time(t)} | {size / t / 1e9:.0f} | {t / flat_s:.2f}× |")
    print(flush=True)
    return {"label": label, "tensors": len(shapes), "bytes": size, "dtype": dtype_name(dtype), "seconds": times}


def many_times(plan: Plan, params: list[torch.Tensor], flat: torch.Tensor) -> dict[str, float]:
    return {
        "stats(flat): one tensor, same bytes": plan.seconds(lambda: zeroscan.stats(flat)),
        "stats_many(params)": plan.seconds(lambda: zeroscan.stats_many(params)),
        "torch.ops.zeroscan.stats_many (op only)": plan.seconds(lambda: torch.ops.zeroscan.stats_many.default(params, None)),
        "stats_many(params, histogram=True)": plan.seconds(lambda: zeroscan.stats_many(params, histogram=True)),
        "[stats(p) for p in params]": plan.seconds(lambda: [zeroscan.stats(p) for p in params]),
        "torch._foreach_norm(params)": plan.seconds(lambda: torch._foreach_norm(params)),
    }


# ---------------------------------------------------------------- 3. host syncs


def sync_table(plan: Plan, g: torch.Generator) -> dict[str, object]:
    if plan.device.type != "cuda":
        print("| host syncs per call | count |\n|---|---|\n| (all) | needs CUDA |\n")
        return {}
    device = plan.device
    big = on_device("nonfinite_0.01", 3_000_017, torch.float32, device, g)
    xs = [big, on_device("zeros_50", 4099, torch.bfloat16, device, g), big[::3], torch.randint(-5, 5, (77,), device=device)]
    torch.cuda.synchronize()
    calls: dict[str, Callable[[], object]] = {
        "stats(x)": lambda: zeroscan.stats(big),
        "stats(x, histogram=True)": lambda: zeroscan.stats(big, histogram=True),
        "stats_many(xs)": lambda: zeroscan.stats_many(xs),
        "stats_many(xs, histogram=True)": lambda: zeroscan.stats_many(xs, histogram=True),
        "scan_buffers(xs)": lambda: zeroscan.scan_buffers(xs),
        "control: stats(x).zeros (a read: 1 expected)": lambda: zeroscan.stats(big).zeros,
    }
    counts = {name: count_syncs(fn) for name, fn in calls.items()}
    print("| host syncs per call | count |")
    print("|---|---|")
    for name, count in counts.items():
        print(f"| {name} | {count} |")
    print(flush=True)
    return counts


# ---------------------------------------------------------------- 4. graphs


def graph_table(plan: Plan, g: torch.Generator) -> dict[str, object]:
    if plan.device.type != "cuda":
        print("| CUDA graph | result |\n|---|---|\n| (all) | needs CUDA |\n")
        return {}
    device = plan.device
    big = on_device("nonfinite_0.01", 64 * MB // 4, torch.float32, device, g)
    small = [torch.randn(shape, device=device, dtype=torch.bfloat16) for shape in small_shapes(plan.small_tensors, g)]
    cases: dict[str, Callable[[], object]] = {
        "stats(64 MB float32)": lambda: torch.ops.zeroscan.stats.default(big, None),
        f"stats_many({len(small):,} small bfloat16)": lambda: torch.ops.zeroscan.stats_many.default(small, None),
        f"stats_many_hist({len(small):,} small bfloat16)": lambda: torch.ops.zeroscan.stats_many_hist.default(small, None),
    }
    out: dict[str, object] = {}
    print("| captured in a CUDA graph | eager | replay | replay / eager | replay after new data == eager |")
    print("|---|---|---|---|---|")
    for name, fn in cases.items():
        try:
            out[name] = one_graph(plan, fn, [big, *small], g)
        except Exception as e:  # a failed capture is a result to report, not the end of the run
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            print(f"| {name} | | | | FAILED: {out[name]['error']} |")
            continue
        r = out[name]
        print(f"| {name} | {fmt_time(r['eager_s'])} | {fmt_time(r['replay_s'])} | {r['replay_s'] / r['eager_s']:.2f}× | {r['equal']} |")
    print(flush=True)
    return out


def one_graph(plan: Plan, fn: Callable[[], object], inputs: list[torch.Tensor], g: torch.Generator) -> dict[str, object]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch's docs ask
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    for x in inputs:  # new values in place: a replay must see them
        x.copy_(torch.randn(x.shape, generator=g).to(x.dtype))
    graph.replay()
    eager = fn()
    torch.cuda.synchronize()
    outputs = (captured,) if isinstance(captured, torch.Tensor) else tuple(captured)
    expected = (eager,) if isinstance(eager, torch.Tensor) else tuple(eager)
    equal = all(torch.equal(a, b) for a, b in zip(outputs, expected))
    return {"eager_s": plan.seconds(fn), "replay_s": plan.seconds(graph.replay), "equal": equal}


# ---------------------------------------------------------------- summary


def summary(results: dict[str, object]) -> list[tuple[str, str, str]]:
    """(what, measured, target) for each figure a target is set on."""
    rows: list[tuple[str, str, str]] = []
    for table in results.get("bandwidth", []):
        worst = min(min(r["stats_of_copy"].values()) for r in table["rows"])
        target = STATS_TARGET.get(table["dtype"], 0.90)
        rows.append((f"stats, {table['dtype']}: worst distribution, % of copy GB/s", f"{worst:.0%}", f">= {target * 100:.0f} %"))
        hist = min(min(r["histogram_of_copy"].values()) for r in table["rows"])
        rows.append((f"stats(histogram=True), {table['dtype']}: worst, % of copy GB/s", f"{hist:.0%}", f">= {HISTOGRAM_TARGET * 100:.0f} %"))
    for table in results.get("many", []):
        t = table["seconds"]
        flat = t["stats(flat): one tensor, same bytes"]
        rows.append((f"stats_many / flat, {table['label']}", f"{t['stats_many(params)'] / flat:.2f}×", "<= 1.15×"))
        rows.append(
            (f"stats_many / _foreach_norm, {table['label']}", f"{t['stats_many(params)'] / t['torch._foreach_norm(params)']:.2f}×", "< 1×")
        )
    syncs = results.get("syncs") or {}
    if syncs:
        scans = {k: v for k, v in syncs.items() if not k.startswith("control")}
        rows.append(("host syncs of stats / stats_many / histogram forms", str(max(scans.values())), "0"))
        rows.append(("host syncs of the control (proves the counter works)", str(syncs[next(k for k in syncs if k.startswith("control"))]), "1"))
    graphs = results.get("graphs") or {}
    if graphs:
        ok = all(isinstance(r, dict) and r.get("equal") is True for r in graphs.values())
        rows.append(("stats / stats_many captured and replayed == eager", "yes" if ok else "NO", "yes"))
    training = results.get("training") or {}
    for key, (what, target) in {
        "monitor_overhead": ("Monitor every=1: % of the training step", "<= 1 %"),
        "monitor_step_syncs": ("host syncs of a Monitor step", "0"),
        "graph_step_equal": ("training step + Monitor captured and replayed == eager", "yes"),
    }.items():
        if key in training:
            value = training[key]
            shown = f"{value:.2%}" if isinstance(value, float) else ("yes" if value is True else "NO" if value is False else str(value))
            rows.append((what, shown, target))
    return rows


def parse_sizes(text: str) -> list[int]:
    """--sizes "256,1024" -> [256, 1024] (MB), or a one-line exit naming what was received."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(mb <= 0 for mb in sizes):
        raise SystemExit(f"bench_cuda.py: --sizes takes positive whole MB, comma-separated (e.g. 256,1024); got {text!r}")
    return sizes


def parse_dtypes(text: str) -> tuple[torch.dtype, ...]:
    """--dtypes "float32,float16" -> the torch dtypes, or a one-line exit naming what was received."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    scanned = {dtype_name(d): d for d in FLOAT_DTYPES}
    if not names or any(n not in scanned for n in names):
        raise SystemExit(f"bench_cuda.py: --dtypes takes some of {','.join(scanned)}, comma-separated; got {text!r}")
    return tuple(scanned[n] for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="sizes up to 256 MB, 1B shapes, a small training step")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes on any device: checks the code paths only")
    parser.add_argument("--device", default="cuda", help="default cuda; cpu only with --smoke")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--sizes", default=None, help="the bandwidth table's tensor sizes in MB, comma-separated (default: the mode's)")
    parser.add_argument(
        "--dtypes", default=",".join(BANDWIDTH_DTYPES), help=f"the bandwidth table's dtypes, comma-separated (default {','.join(BANDWIDTH_DTYPES)})"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default=None, help="stats_many's transformer shapes (default 7b)")
    parser.add_argument("--model-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="seed of the host-drawn values")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"bench_cuda.py: --only takes {', '.join(SECTIONS)}; got {', '.join(unknown)}")
    sizes_mb = parse_sizes(args.sizes) if args.sizes is not None else None
    dtypes = parse_dtypes(args.dtypes)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py: --device cuda needs a CUDA device (torch.cuda.is_available() is False); try --device cpu --smoke")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit(f"bench_cuda.py: --device {args.device} is only for --smoke (the figures are GPU figures)")
    run_mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    plan = Plan(run_mode, device, args.model, getattr(torch, args.model_dtype), sizes_mb, dtypes)
    g = torch.Generator().manual_seed(args.seed)
    machine = describe_machine(device)
    print(f"# zeroscan CUDA benchmark ({plan.mode}) — {machine}\n")
    results: dict[str, object] = {"machine": machine, "mode": plan.mode}
    if "bandwidth" in only:
        results["bandwidth"] = bandwidth_tables(plan, g)
    if "many" in only:
        results["many"] = many_tables(plan, g)
    if "syncs" in only:
        results["syncs"] = sync_table(plan, g)
    if "graphs" in only:
        results["graphs"] = graph_table(plan, g)
    if "training" in only:
        progress(f"training step ({plan.training})")
        results["training"] = training_tables(device, plan.training)
    rows = summary(results)
    results["summary"] = rows
    write_json(args.json, results)
    print(f"## Summary — {machine}\n")
    print("| figure | measured | target |")
    print("|---|---|---|")
    for what, measured, target in rows:
        print(f"| {what} | {measured} | {target} |")


if __name__ == "__main__":
    main()
