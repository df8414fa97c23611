"""Cost of merging zeroscan statistics across ranks, per step, vs the local scan.

Spawns `--world` gloo processes (CPU) that each hold a transformer-sized
parameter list, and times, per training step:

  scan full       zeroscan.scan_buffers over every parameter (a DDP replica)
  scan shard      the same over this rank's 1/world of each parameter (FSDP)
  all_gather      every rank's int64 [N, 16] rows (gather_rows: compare_replicas, by hand)
  combine         the local exact (Chan) merge of the gathered rows
  replica check   replica_report on gathered full-parameter rows (no rank differs)
  all-reduce merge the two rounds of zeroscan/distributed/allreduce.py over the shard rows (the
                  Monitor's and zeroscan.distributed's merge; its size does not grow with W)
  merge_stats     StatsBatch -> rows -> the all-reduce merge, end to end
  DTensor stats   zeroscan.distributed.stats_many over Shard(0) DTensors
  scan + async    shard scan with the previous step's gather_rows in flight (the old design)

Each row is the median (and min) over --steps steps; ratios divide medians by
"scan shard" and "scan full" measured in the same run.
Usage: python benchmarks/bench_distributed.py [--world 2] [--layers 12] [--width 384]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

import zeroscan
import zeroscan.distributed as zd
from zeroscan.distributed import allreduce
from timing import time_batches


def parameters(layers: int, width: int, vocab: int, g: torch.Generator) -> list[torch.Tensor]:
    """The shapes of a GPT-style model: embeddings, then per layer attention,
    MLP, norms and biases (float32)."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (1024, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    shapes += [(width,), (width,)]
    return [torch.randn(s, generator=g) * 0.02 for s in shapes]


def timed(fn: Callable[[], object], steps: int) -> tuple[float, float]:
    """(median, min) seconds per call, every rank starting each call together.
    The min is the cost without interference from other processes."""
    times = time_batches(fn, steps, before_batch=dist.barrier)
    return statistics.median(times), min(times)


def worker(rank: int, args: argparse.Namespace, store: str, queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.world)
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    params = parameters(args.layers, args.width, args.vocab, torch.Generator().manual_seed(0))
    shards = [p.tensor_split(args.world)[rank] for p in params]
    mesh = init_device_mesh("cpu", (args.world,))
    dtensors = [distribute_tensor(p, mesh, [Shard(0)]) for p in params]
    (rows,) = zeroscan.scan_buffers(shards)
    gathered = zd.gather_rows(rows)
    replicas = zd.gather_rows(zeroscan.scan_buffers(params)[0])  # every rank holds the same params
    batch = zeroscan.stats_many(shards)
    n = rows.shape[0]
    local = allreduce.Local(
        rows, torch.ones(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool),
        torch.tensor([rank]), torch.zeros(allreduce.NUM_HEADER, dtype=torch.int64),
    )

    def scan_and_overlap() -> None:
        pending = zd.gather_rows(rows, async_op=True)  # the previous step's rows
        zeroscan.scan_buffers(shards)
        pending.wait().merged()

    def sequential() -> None:
        zeroscan.scan_buffers(shards)
        zd.gather_rows(rows).merged()

    results = {
        "scan full": timed(lambda: zeroscan.scan_buffers(params), args.steps),
        "scan shard": timed(lambda: zeroscan.scan_buffers(shards), args.steps),
        "all_gather": timed(lambda: zd.gather_rows(rows), args.steps),
        "combine": timed(gathered.merged, args.steps),
        "replica check": timed(replicas.replica_report, args.steps),
        "all-reduce merge": timed(lambda: allreduce.start(local, dist.group.WORLD), args.steps),
        "merge_stats": timed(lambda: zd.merge_stats(batch), args.steps),
        "DTensor stats": timed(lambda: zd.stats_many(dtensors), args.steps),
        "scan + merge, sequential": timed(sequential, args.steps),
        "scan + merge, async": timed(scan_and_overlap, args.steps),
    }
    if rank == 0:
        queue.put((results, len(params), sum(p.numel() for p in params)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2), help="per process")
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=worker, args=(r, args, store, queue)) for r in range(args.world)]
        for p in procs:
            p.start()
        results, n_tensors, numel = queue.get(timeout=600)
        for p in procs:
            p.join()

    print(
        f"gloo, {args.world} processes x {args.threads} thread(s), torch {torch.__version__}; "
        f"{n_tensors} float32 parameters, {numel / 1e6:.1f} M elements; "
        f"gathered per step: {args.world} x {n_tensors} x 128 B = {args.world * n_tensors * 128 / 1024:.1f} KiB; "
        f"all-reduced: {allreduce.payload_bytes(n_tensors) / 1024:.1f} KiB at any world size"
    )
    shard, full = results["scan shard"][0], results["scan full"][0]
    print(f"{'per step':<26}{'median ms':>11}{'min ms':>10}{'/ scan shard':>14}{'/ scan full':>13}")
    for name, (median, best) in results.items():
        print(f"{name:<26}{median * 1e3:>11.3f}{best * 1e3:>10.3f}{median / shard:>14.3f}{median / full:>13.3f}")
    print("ratios use the medians")

if __name__ == "__main__":
    main()
