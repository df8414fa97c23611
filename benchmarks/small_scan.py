"""A small scan through every native CUDA op, checked against the float64
reference: the program that gpu_check.sh runs under compute-sanitizer.

It is kept small (a few thousand elements per tensor, one or two blocks per
kernel and a few multi-tile tensors) because memcheck and racecheck slow a
kernel by 10-100x, yet it reaches every kernel: each dtype's contiguous and
strided kernels, stats_many over mixed tensors, the histogram forms, and the
cross-rank merge (combine_rows). Exits 1 on the first disagreement.

    compute-sanitizer --tool memcheck python benchmarks/small_scan.py
    python benchmarks/small_scan.py --device cpu      # the same checks on CPU
    python benchmarks/small_scan.py --kernels-only    # is every op's CUDA kernel in this build? (no GPU needed)
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import zeroscan
from zeroscan.ops import FLOAT_DTYPES, INT_DTYPES
from zeroscan.result_row import Column
from zeroscan.testing import distributions_for, make_distribution

COUNTS = ("numel", "zeros", "subnormal", "near_zero", "nan", "posinf", "neginf", "negative", "finite")
EXTREMES = ("min_abs", "min_abs_nonzero", "max_abs")
SIZES = (1, 4099, 70_001)  # one element, one block, several tiles
# The ops csrc/cuda/stats_cuda.cpp implements (stats_many_mapped's CUDA entry,
# in csrc/cpu, says that mapped files are read on the CPU).
CUDA_OPS = ("stats", "stats_many", "stats_many_hist", "combine_rows", "stats_many_mapped")


def missing_cuda_kernels() -> list[str]:
    """The zeroscan ops that this build registered no CUDA kernel for."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [op for op in CUDA_OPS if not has(f"zeroscan::{op}", "CUDA")]


def disagreement(s: zeroscan.Stats, x: torch.Tensor) -> str | None:
    """What differs between s and the float64 reference of x: counts and
    extremes exactly, the sum within 1e-6 of the sum of |x|."""
    ref = zeroscan.reference_stats(x.cpu())
    got = s.to_dict()
    for key in COUNTS + EXTREMES:
        a, b = got[key], ref[key]
        if not (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))):
            return f"{key}: {a!r}, reference {b!r}"
    scale = float(x.cpu().double().abs().nan_to_num(0.0, 0.0, 0.0).sum()) + 1e-30
    if ref["finite"] and abs(got["sum"] - ref["sum"]) > 1e-6 * scale:
        return f"sum: {got['sum']!r}, reference {ref['sum']!r}"
    return None


def tensors(device: torch.device, g: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """Every dtype and distribution at each size, contiguous and as a strided
    2-D view (a transposed slice, so the strided kernel runs)."""
    out = []
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        for dist in distributions_for(dtype):
            for n in SIZES:
                x = make_distribution(dist, n, dtype, g).to(device)
                label = f"{str(dtype).removeprefix('torch.')} {dist} {n}"
                out.append((label, x))
                if n >= 64:
                    cols = 8
                    view = x[: n - n % cols].view(-1, cols)[:, 1::2].t()
                    out.append((f"{label} strided", view))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels-only", action="store_true", help="only check that every op has a CUDA kernel")
    args = parser.parse_args()
    if args.kernels_only:
        missing = missing_cuda_kernels()
        print(f"small_scan: CUDA kernels registered for {'every op' if not missing else 'NOT ' + ', '.join(missing)}"
              f" ({', '.join(CUDA_OPS)}), torch {torch.__version__}")
        return 1 if missing else 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("small_scan.py: no CUDA device (torch.cuda.is_available() is False); try --device cpu", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    cases = tensors(device, g)
    failures = []
    for label, x in cases:
        for histogram in (False, True):
            problem = disagreement(zeroscan.stats(x, histogram=histogram), x)
            if problem:
                failures.append(f"stats({label}, histogram={histogram}): {problem}")
    xs = [x for _, x in cases]
    for histogram in (False, True):
        for (label, x), s in zip(cases, zeroscan.stats_many(xs, histogram=histogram)):
            problem = disagreement(s, x)
            if problem:
                failures.append(f"stats_many[{label}], histogram={histogram}: {problem}")
    # The merge kernel: rows of the pieces of one tensor combine into the row of the whole.
    whole = make_distribution("nonfinite_0.01", 70_001, torch.float32, g).to(device)
    pieces = torch.ops.zeroscan.stats_many.default(list(whole.tensor_split(5)), None)
    merged = torch.ops.zeroscan.combine_rows.default(pieces.unsqueeze(1))[0]  # as 5 ranks' [1, 16] rows
    exact = slice(Column.NUMEL, Column.MAX_ABS + 1)  # the counts and extremes merge exactly
    if not torch.equal(merged[exact], torch.ops.zeroscan.stats.default(whole, None)[exact]):
        failures.append("combine_rows of 5 pieces: its counts or extremes differ from one scan of the whole")
    if device.type == "cuda":
        torch.cuda.synchronize()
    for failure in failures:
        print(f"small_scan: {failure}", file=sys.stderr)
    print(f"small_scan: {len(cases)} tensors x 2 (plain, histogram), stats and stats_many, on {device}: "
          f"{'OK' if not failures else f'{len(failures)} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
