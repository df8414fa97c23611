"""An adversarial search for inputs whose moments leave the documented accuracy.

Plants blocks of outliers (sizes, magnitudes, signs and positions inside and
across the CPU's 65536-element chunks) into offset data (`loc + spread * randn`)
and compares zeroscan.stats with zeroscan.reference_stats. Prints the worst
error of each field, as a multiple of the README's bound (1e-6 relative for
8/16/32-bit floats, 1e-10 for float64; the mean with the test suite's floor of
1e-12 * mean |x|), so a figure above 1 is a failure. The CPU paths of lesser
CPUs are searched by running under ZEROSCAN_CPU_CAPABILITY=scalar / avx512.

    python benchmarks/moment_accuracy_search.py [--cases N] [--seed S] [--max-numel N]
"""

from __future__ import annotations

import argparse
import math
import random

import torch

import zeroscan

CHUNK = 1 << 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float64]


def bound(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 1e-6


def planted(rng: random.Random, g: torch.Generator, dtype: torch.dtype, max_numel: int) -> tuple[torch.Tensor, str]:
    """Offset data with blocks of outliers planted; and a description."""
    top = float(torch.finfo(dtype).max)
    n = rng.choice([CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 7, 3 * CHUNK, rng.randrange(64, max_numel)])
    n = min(n, max_numel)
    loc = rng.choice([0.0, 1.0, 3.0, 100.0, 1000.0, -7.0]) if dtype.itemsize > 1 else rng.choice([0.0, 1.0, 8.0, -3.0])
    spread = abs(loc) * rng.choice([1e-3, 1e-2, 1e-1]) if loc else rng.choice([1e-3, 1.0])
    base = loc + spread * torch.randn(n, generator=g, dtype=torch.float64)
    blocks = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        size = rng.choice([1, 3, 16, 63, 64, 65, 200, 1000, 4096, CHUNK // 2, CHUNK - 64])
        if rng.random() < 0.5:
            # An absolute outlier, which dominates the spread.
            value = rng.choice([1, -1]) * min(top / 4, rng.choice([10.0, 100.0, 1e4, 1e6, 1e10, 1e20, 1e30]))
        else:
            # A few spreads off the offset: the shift that the first values
            # pick may be off by about as much as the cancellation check allows.
            value = loc + rng.choice([1, -1]) * spread * rng.choice([1.0, 1.5, 1.7, 1.8, 2.0, 3.0, 10.0])
        where = rng.choice(["start", "chunk_start", "chunk_end", "across", "random"])
        chunk = rng.randrange(max(1, n // CHUNK + 1))
        at = {
            "start": 0,
            "chunk_start": chunk * CHUNK,
            "chunk_end": chunk * CHUNK + CHUNK - size,
            "across": chunk * CHUNK + CHUNK - size // 2,
            "random": rng.randrange(n),
        }[where]
        at = max(0, min(n - 1, at))
        noisy = rng.random() < 0.5  # the block itself spread or constant
        block = torch.full((size,), value, dtype=torch.float64)
        if noisy:
            block *= 1 + 1e-3 * torch.randn(size, generator=g, dtype=torch.float64)
        end = min(n, at + size)
        base[at:end] = block[: end - at]
        blocks.append(f"{end - at}x{value:g}@{where}:{at}")
    x = base.to(dtype)
    if rng.random() < 0.3:
        x = torch.stack([x, torch.zeros_like(x)], 1).reshape(-1)[::2]  # strided view, same values
        assert not x.is_contiguous() or x.numel() <= 1
        layout = "strided"
    else:
        layout = "contiguous"
    return x, f"{dtype} n={n} {layout} loc={loc:g} spread={spread:g} " + " ".join(blocks)


def errors(x: torch.Tensor) -> dict[str, float]:
    """Each moment's error as a multiple of its bound."""
    got = zeroscan.stats(x).to_dict()
    want = zeroscan.reference_stats(x)
    finite = x.to(torch.float64)
    finite = finite[finite.isfinite()]
    scale = float(finite.abs().mean())
    rtol = bound(x.dtype)
    out = {}
    for field in ("mean", "std", "norm"):
        w, g = float(want[field]), float(got[field])
        if math.isnan(w) and math.isnan(g):
            out[field] = 0.0
            continue
        allowed = rtol * abs(w) + (1e-12 * scale if field == "mean" else 0.0)
        out[field] = abs(g - w) / allowed if allowed > 0 else (0.0 if g == w else math.inf)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-numel", type=int, default=3_000_000)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    worst: dict[tuple[torch.dtype, str], tuple[float, str]] = {}
    for k in range(args.cases):
        dtype = DTYPES[k % len(DTYPES)]
        x, what = planted(rng, g, dtype, args.max_numel)
        for field, e in errors(x).items():
            if e > worst.get((dtype, field), (-1.0, ""))[0]:
                worst[(dtype, field)] = (e, what)
            if e > 1:
                print(f"OVER  {field} {e:.3g}x bound: {what}")
    for (dtype, field), (e, what) in sorted(worst.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        print(f"{str(dtype):22} {field:5} worst {e:8.3g}x bound  {what}")


if __name__ == "__main__":
    main()
