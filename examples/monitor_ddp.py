"""Data-parallel training (DDP) on two CPU processes, watched by one
zeroscan.Monitor per rank over the process group: after the gradients are
all-reduced, rank 1 alone gets a NaN in one of them. The report, the same on
every rank, names that gradient, "replica_mismatch", and rank 1.

    python examples/monitor_ddp.py
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zeroscan

TIMEOUT_S = 120.0


def train(
    seed: int, *, steps: int = 5, nan_rank: int | None = 1, nan_param: str = "module.2.weight"
) -> zeroscan.Monitor:
    """Trains a small MLP with DDP inside an initialized process group; at the
    last step `nan_rank` (None: no rank) writes a NaN into the gradient of
    `nan_param` after the all-reduce. Returns the (closed) Monitor: nothing
    has been read back yet, and its report() issues no collective."""
    rank = dist.get_rank()
    torch.manual_seed(seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed * 1009 + rank + 1)  # every rank its own batches
    with zeroscan.Monitor(ddp, opt, process_group=dist.group.WORLD) as monitor:
        for step in range(steps):
            x = torch.randn(32, 16, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), x[:, :4].sin()).backward()  # DDP all-reduces here
            if step == steps - 1 and rank == nan_rank:
                grad = dict(ddp.named_parameters())[nan_param].grad
                grad.view(-1)[grad.numel() // 2] = float("nan")  # this rank only
            opt.step()  # the Monitor scans here and merges its rows across ranks (all-reduces)
    return monitor


def _worker(rank: int, world: int, store: str, out_dir: str, seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        report = train(seed).report()  # reads the merged rows back; no collective
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"text": str(report), "report": report.to_dict()}))
    finally:
        dist.destroy_process_group()


def run(seed: int = 0, world: int = 2) -> list[dict[str, Any]]:
    """Spawns `world` gloo processes running train(seed); returns each rank's
    {"text": str(report), "report": report.to_dict()}, rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(r, world, str(Path(tmp, "store")), tmp, seed), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        paths = [Path(tmp, f"rank{r}.json") for r in range(world)]
        if not all(path.exists() for path in paths):
            raise RuntimeError(f"monitor_ddp: a rank failed (exit codes {[p.exitcode for p in procs]})")
        return [json.loads(path.read_text()) for path in paths]


if __name__ == "__main__":
    for rank, result in enumerate(run()):
        print(f"--- rank {rank}\n{result['text']}")
