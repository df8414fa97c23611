"""zeroscan.scan_checkpoint: read throughput on a large checkpoint, and the
cost per entry on a file of many tiny tensors.

Two measurements, both with the file in the page cache (it is read once
before timing):

* throughput: a float32 checkpoint of about --gib GiB (a few large matrices
  and many small ones, like a model), written once as .safetensors and once
  with torch.save; GB/s of scan_checkpoint, best of --repeat runs;
* per entry: a .safetensors file of --entries tiny float32 tensors named like
  a model's parameters; seconds of scan_checkpoint divided by the entries,
  best of --repeat runs, and with --profile the top of a cProfile of one run.

    python benchmarks/bench_checkpoint.py --dir /tmp/zs_bench
    python benchmarks/bench_checkpoint.py --dir /tmp/zs_bench --entries 200000 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from timing import describe_machine, progress
from zeroscan.checkpoint import scan_checkpoint


def large_model(gib: float) -> dict[str, torch.Tensor]:
    """About `gib` GiB of float32: 64 MiB matrices, each with a bias and a norm scale."""
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    rows, cols = 4096, 4096
    for i in range(max(1, round(gib * 1024 / 64))):
        tensors[f"layers.{i}.linear.weight"] = torch.randn(rows, cols, generator=g)
        tensors[f"layers.{i}.linear.bias"] = torch.zeros(rows)
        tensors[f"layers.{i}.norm.weight"] = torch.ones(cols)
    return tensors


def tiny_model(entries: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(entries, 4, generator=g)
    kinds = ("attn.q.weight", "attn.q.bias", "norm.weight", "mlp.up.weight")
    return {f"model.layers.{i // 4}.{kinds[i % 4]}": values[i].clone() for i in range(entries)}


def ensure(path: Path, make: object, save: object) -> Path:
    if not path.exists():
        progress(f"writing {path}")
        save(path, make())  # type: ignore[operator]
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    return path


def best_seconds(path: Path, repeat: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of the fastest of `repeat` scans. CPU time
    counts the work of every thread of the scan and none of other processes'."""
    times = []
    for _ in range(repeat):
        start, cpu = time.perf_counter(), time.process_time()
        scan_checkpoint(path)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/zeroscan_bench_checkpoint")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--entries", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--skip-tiny", action="store_true")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(describe_machine())
    if not args.skip_large:
        for suffix, save in (("safetensors", lambda p, t: save_file(t, p)), ("pt", lambda p, t: torch.save(t, p))):
            path = ensure(root / f"large_{args.gib:g}gib.{suffix}", lambda: large_model(args.gib), save)
            seconds, cpu = best_seconds(path, args.repeat)
            size = os.path.getsize(path)
            print(f"{suffix:12s} {size / 2**30:.2f} GiB  {seconds:.3f} s  {size / seconds / 1e9:.2f} GB/s"
                  f"  (CPU {cpu:.3f} s)")
    if args.skip_tiny:
        return
    path = ensure(root / f"tiny_{args.entries}.safetensors", lambda: tiny_model(args.entries),
                  lambda p, t: save_file(t, p))
    seconds, cpu = best_seconds(path, args.repeat)
    print(f"{args.entries} tiny entries  {seconds:.3f} s  {seconds / args.entries * 1e6:.1f} µs per entry"
          f"  (CPU {cpu / args.entries * 1e6:.1f} µs)")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(scan_checkpoint, path)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
