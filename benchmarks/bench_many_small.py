"""stats_many over many small tensors against stats of one flat tensor of the
same bytes, and the Python part of the call alone (issue 42, item 3).

For each count N of tensors (sizes log-uniform over 256 .. 64K elements, as
bench_cuda's "2,000 small tensors"), timed in ONE run:
  flat      zeroscan.stats(flat), one tensor of the same dtype and elements:
            the baseline every other row is a ratio to
  many      zeroscan.stats_many(xs)
  op        torch.ops.zeroscan.stats_many.default(xs, None): the native op
            alone, the Python-to-C++ conversion of the list included
  wrapper   stats_many(xs) with its native call replaced by a stub that
            returns a result buffer made beforehand: the Python work of the
            call alone, also given in µs per call and ns per tensor, so that
            a cost growing per tensor shows across the N
  read      [s.zeros for s in stats_many(xs)]: the call, then one field of
            every tensor (each Stats is made when first indexed)

    python benchmarks/bench_many_small.py                   # N = 100, 1,000, 2,000, 8,000; bfloat16; CPU
    python benchmarks/bench_many_small.py --device cuda     # the same on a GPU
    python benchmarks/bench_many_small.py --quick           # shorter timing

Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import importlib
from unittest import mock

import torch

import zeroscan
from bench_cuda import small_shapes
from timing import best_per_call, describe_machine, device_sync, dtype_name, fmt_time, progress, write_json
from zeroscan.stats import Readout

COUNTS = (100, 1000, 2000, 8000)
# The module whose native call the wrapper row replaces: the name
# zeroscan.stats is the function, which hides it.
STATS_MODULE = importlib.import_module("zeroscan.stats")


def times_for(count: int, dtype: torch.dtype, device: torch.device, budget: float) -> dict[str, float]:
    """Seconds per call of each row of the module doc, for `count` tensors."""
    g = torch.Generator().manual_seed(count)
    xs = [torch.randn(shape, generator=g).to(device=device, dtype=dtype) for shape in small_shapes(count, g)]
    flat = torch.randn(sum(x.numel() for x in xs), generator=g).to(device=device, dtype=dtype)
    sync = device_sync(device)
    op = torch.ops.zeroscan.stats_many.default
    rows = op(xs, None)  # what the stub returns: the call's Python work is timed on a real result

    def call_op() -> object:
        # As stats_many calls the op: from C++ for CPU tensors, else torch.ops.
        if device.type == "cpu":
            return zeroscan._C.stats_many_call(xs, None, False)
        return op(xs, None)

    def stub(tensors: list[torch.Tensor], tol: float | None, histogram: bool) -> Readout:
        return Readout(rows)

    out = {
        "flat": best_per_call(lambda: zeroscan.stats(flat), budget, sync=sync),
        "many": best_per_call(lambda: zeroscan.stats_many(xs), budget, sync=sync),
        "op": best_per_call(call_op, budget, sync=sync),
        "read": best_per_call(lambda: [s.zeros for s in zeroscan.stats_many(xs)], budget, sync=sync),
    }
    with mock.patch.object(STATS_MODULE, "_scan_many_now", stub):
        out["wrapper"] = best_per_call(lambda: zeroscan.stats_many(xs), budget, sync=sync)
    out["elements"] = flat.numel()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", help="a torch dtype name (default bfloat16)")
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    parser.add_argument("--quick", action="store_true", help="0.2 s per row instead of 1 s")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    budget = 0.2 if args.quick else 1.0

    results = {}
    for count in args.counts:
        progress(f"{count:,} tensors")
        results[count] = times_for(count, dtype, device, budget)

    print(f"Machine: {describe_machine(device)}; {dtype_name(dtype)}, tensors of 256..64K elements\n")
    print("| tensors | elements | stats(flat) | stats_many / flat | op / flat | read one field of each / flat "
          "| wrapper / flat | wrapper per call | wrapper per tensor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for count, t in results.items():
        flat = t["flat"]
        print(
            f"| {count:,} | {t['elements'] / 1e6:.1f}M | {fmt_time(flat)} | {t['many'] / flat:.2f}× "
            f"| {t['op'] / flat:.2f}× | {t['read'] / flat:.2f}× | {t['wrapper'] / flat:.3f}× "
            f"| {t['wrapper'] * 1e6:.1f} µs | {t['wrapper'] / count * 1e9:.1f} ns |"
        )
    write_json(args.json, {"machine": describe_machine(device), "dtype": dtype_name(dtype), "results": results})


if __name__ == "__main__":
    main()
