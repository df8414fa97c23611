"""`zeroscan scan` on a sharded bfloat16 model checkpoint of about --gib GiB
(default 8), against reading the same bytes, warm page cache, in one run.

The checkpoint is a Hugging Face folder: model-0000k-of-0000n.safetensors
shards of about --shard-gib GiB plus model.safetensors.index.json, made of
4096 x 4096 matrices with small norm vectors between them, like a model's
layers. Each shard holds one data distribution, as the scan's work depends
on the values: normal, 50 % zeros, 99 % zeros, all zeros, all subnormal,
normal with subnormals and NaN sprinkled (one in 1,000 each).

Measured, best of --repeat, alternating so that drift hits all alike, each
in a fresh child process whose peak RSS (ru_maxrss) is recorded:

* cat: `cat SHARDS > /dev/null`, the rate of copying the bytes once;
* mmap sum: safetensors' safe_open (memory-mapped) and x.sum() per tensor,
  the memory floor of a pass over every tensor;
* zeroscan: `zeroscan scan FOLDER --json > /dev/null`, the whole command;

and per shard (distribution), zeroscan.scan_checkpoint and the mmap sum of
that shard alone, to find the worst distribution.

    python benchmarks/bench_sharded.py --dir /tmp/zs_sharded            # 8 GiB
    python benchmarks/bench_sharded.py --dir /tmp/zs_small --gib 1 --shard-gib 0.25
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from timing import describe_machine, progress

ROWS = COLS = 4096
DISTRIBUTIONS = ("normal", "zeros 50%", "zeros 99%", "all zero", "all subnormal", "sprinkled subnormal+NaN")


def values(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    """n bfloat16 values of one distribution."""
    if kind == "all zero":
        return torch.zeros(n, dtype=torch.bfloat16)
    if kind == "all subnormal":  # bfloat16's subnormals: below 2**-126, above 0
        return (torch.rand(n, generator=g) * 2.0**-127 + 2.0**-133).bfloat16()
    x = torch.randn(n, generator=g).bfloat16()
    if kind.startswith("zeros"):
        keep = 0.5 if kind == "zeros 50%" else 0.01
        x[torch.rand(n, generator=g) >= keep] = 0
    elif kind.startswith("sprinkled"):
        x[torch.randint(0, n, (n // 1000,), generator=g)] = 2.0**-130
        x[torch.randint(0, n, (n // 1000,), generator=g)] = float("nan")
    return x


def write_checkpoint(folder: Path, gib: float, shard_gib: float) -> list[Path]:
    """The shards (written once; kept between runs) and the index."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    matrix_bytes = ROWS * COLS * 2
    per_shard = max(1, round(shard_gib * 2**30 / matrix_bytes))
    n_shards = max(1, round(gib * 2**30 / (per_shard * matrix_bytes)))
    g = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    layer = 0
    paths = []
    for k in range(n_shards):
        kind = DISTRIBUTIONS[k % len(DISTRIBUTIONS)]
        name = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        progress(f"writing {name} ({kind})")
        tensors: dict[str, torch.Tensor] = {}
        for _ in range(per_shard):
            tensors[f"model.layers.{layer}.mlp.weight"] = values(kind, ROWS * COLS, g).reshape(ROWS, COLS)
            tensors[f"model.layers.{layer}.norm.weight"] = torch.ones(COLS, dtype=torch.bfloat16)
            layer += 1
        save_file(tensors, str(folder / name), metadata={"format": "pt", "distribution": kind})
        weight_map.update({t: name for t in tensors})
        paths.append(folder / name)
        del tensors
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return paths


# Each measurement runs in a fresh child process, so that its peak RSS is its
# own, and times only the work (not starting Python and importing torch).
CHILD = """
import json, os, resource, sys, time
import torch
from safetensors import safe_open
import zeroscan.cli
what, paths = sys.argv[1], sys.argv[2:]
start = time.perf_counter()
if what == "mmap sum":
    total = 0.0
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                total += float(f.get_tensor(k).sum())  # torch's own bfloat16 sum: its fast path
else:
    with open(os.devnull, "w") as devnull:
        sys.stdout = devnull
        zeroscan.cli.main(["scan", *paths, "--json"])
        sys.stdout = sys.__stdout__
seconds = time.perf_counter() - start
print(json.dumps([seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))
"""


def measure(what: str, paths: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of one measurement in a child process."""
    if what == "cat":
        start = time.perf_counter()
        child = subprocess.Popen(["cat", *paths], stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(child.pid, 0)
        return time.perf_counter() - start, usage.ru_maxrss / 1024
    done = subprocess.run([sys.executable, "-c", CHILD, what, *paths], capture_output=True, text=True, check=True)
    seconds, rss = json.loads(done.stdout.splitlines()[-1])
    return seconds, rss


def best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return min(r[0] for r in runs), max(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/zeroscan_bench_sharded")
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--shard-gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--per-shard", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--delete", action="store_true", help="delete the checkpoint afterwards")
    parser.add_argument("--write-only", action="store_true", help="write the checkpoint, measure nothing")
    args = parser.parse_args()
    folder = Path(args.dir)
    shards = write_checkpoint(folder, args.gib, args.shard_gib)
    if args.write_only:
        return
    size = sum(p.stat().st_size for p in shards)
    print(describe_machine())
    print(f"checkpoint: {folder}, {len(shards)} shards, {size / 2**30:.2f} GiB bfloat16, "
          f"torch threads {torch.get_num_threads()}")
    subprocess.run(["cat", *map(str, shards)], stdout=subprocess.DEVNULL, check=True)  # into the page cache

    labels = ("cat", "mmap sum", "zeroscan scan")
    whole = {"cat": [str(p) for p in shards], "mmap sum": [str(p) for p in shards], "zeroscan scan": [str(folder)]}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in labels}
    for r in range(args.repeat):
        for label in labels:
            runs[label].append(measure(label, whole[label]))
            progress(f"run {r + 1}: {label} {runs[label][-1][0]:.2f} s")
    floor = best(runs["mmap sum"])[0]
    print(f"\n| whole checkpoint ({size / 1e9:.2f} GB) | seconds | GB/s | rate vs mmap sum | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|")
    for label in labels:
        seconds, rss = best(runs[label])
        print(f"| {label} | {seconds:.2f} | {size / seconds / 1e9:.2f} | {floor / seconds:.2f} | {rss:.0f} |")

    if not args.per_shard:
        return
    print("\n| shard (distribution) | zeroscan GB/s | mmap sum GB/s | zeroscan rate vs mmap sum |")
    print("|---|---:|---:|---:|")
    worst = None
    for k, path in enumerate(shards[: len(DISTRIBUTIONS)]):
        kind = DISTRIBUTIONS[k % len(DISTRIBUTIONS)]
        nbytes = path.stat().st_size
        scan, total = [], []
        for _ in range(args.repeat):
            scan.append(measure("zeroscan scan", [str(path)]))
            total.append(measure("mmap sum", [str(path)]))
        ratio = best(total)[0] / best(scan)[0]
        worst = ratio if worst is None else min(worst, ratio)
        print(f"| {kind} | {nbytes / best(scan)[0] / 1e9:.2f} | {nbytes / best(total)[0] / 1e9:.2f} | {ratio:.2f} |")
    print(f"\nworst distribution: zeroscan at {worst:.2f} of the mmap sum's rate")
    if args.delete:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
