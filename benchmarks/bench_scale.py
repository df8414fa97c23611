"""The Monitor across ranks, measured at W = 2 and 4 and simulated up to 16,384 ranks.

1. Measured (gloo, CPU): `--world` processes train a DDP model of P
   parameters under Monitor(process_group=WORLD); a counting wrapper around
   torch.distributed's collectives adds up the bytes zeroscan's calls
   receive per rank per monitored step (an all_reduce receives its buffer;
   ring algorithms move up to twice that on the wire), and each kept
   record's bytes are read off the ring.
2. Simulated: a Monitor of P parameters on one process records `--history`
   steps; each step's summary is what rank 0 of a world of W replicas (DDP)
   would hold, from zeroscan.distributed.allreduce.simulate (the same code as the
   collective, over blocks of identical ranks), with one replica that holds
   a NaN in one gradient at a rank in the middle. Timed: report() over the
   whole ring (read back and judged), and the decoding of one step that
   names the mismatched replica.

The "before" columns are the all_gather design this replaced: every rank
received and kept W x (2P + 1) x 128 bytes per step.
Usage: python benchmarks/bench_scale.py [--worlds 2 4] [--sim-worlds 8 256 1024 16384] [--params 300 10000]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroscan
from zeroscan.distributed import allreduce
from zeroscan.monitor.ranks import RankExchange
from zeroscan.monitor.step_record import Slot, slot_rows

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast", "reduce_scatter")


class Layers(nn.Module):
    """P = 2 * layers parameters: small Linear layers, so that the step is cheap and P is what counts."""

    def __init__(self, layers: int, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _counted(name: str, real: Any, tally: dict[str, int]) -> Any:
    @functools.wraps(real)
    def call(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        received = tensors[0] if tensors else None  # all_reduce: the buffer; the gathers: the output first
        if received is not None:
            tally["bytes"] += received.numel() * received.element_size()
        tally["calls"] += 1
        return real(*args, **kwargs)

    return call


def worker(rank: int, world: int, params: int, steps: int, store: str, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Layers(params // 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = zeroscan.Monitor(model, opt, history=steps, process_group=dist.group.WORLD)
    tally = {"bytes": 0, "calls": 0}
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in real.items():
        setattr(dist, name, _counted(name, fn, tally))
    g = torch.Generator().manual_seed(rank + 1)
    try:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).square().mean().backward()  # DDP's own all-reduce is C++: not counted
            opt.step()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    kept = [r.exchange.numel() * r.exchange.element_size() for r in monitor._log.records if r.exchange is not None]
    started = time.perf_counter()
    report = monitor.report()
    report_s = time.perf_counter() - started
    queue.put((rank, tally["bytes"] / steps, tally["calls"] / steps, statistics.mean(kept), report_s,
               len(report.findings)))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, params: int, steps: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=worker, args=(r, world, params, steps, store, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    per_rank = sorted(results)
    return {
        "received": max(r[1] for r in per_rank),
        "calls": per_rank[0][2],
        "kept": max(r[3] for r in per_rank),
        "report_s": max(r[4] for r in per_rank),
    }


# ---------------------------------------------------------------- simulated


def recorded_monitor(params: int, history: int) -> zeroscan.Monitor:
    """A Monitor (no group) of `params` parameters that has recorded `history` steps."""
    g = torch.Generator().manual_seed(0)
    model = nn.Module()
    model.weights = nn.ParameterList(nn.Parameter(torch.randn(64, generator=g)) for _ in range(params))
    monitor = zeroscan.Monitor(model, auto=False, history=history)
    for _ in range(history):
        for p in model.weights:
            p.grad = torch.randn(64, generator=g) * 1e-3
        monitor.step()
    monitor.close()
    return monitor


def replica_blocks(local: allreduce.Local, world: int, odd: int, odd_slot: int) -> tuple[allreduce.Local, list[int]]:
    """The inputs of a world of `world` DDP replicas as blocks: rank 0 (whose
    copy counts), the ranks before `odd`, rank `odd` (a NaN in the gradient at
    Slot row `odd_slot`), the ranks after it."""
    others = local._replace(counted=local.sharded.clone())  # replicas count on rank 0 only
    odd_rows = local.rows.clone()
    odd_rows[odd_slot, zeroscan.result_row.Column.NAN] += 1
    blocks = [(local, 0, 1), (others, 1, odd - 1), (others._replace(rows=odd_rows), odd, 1),
              (others, odd + 1, world - odd - 1)]
    blocks = [(b, first, n) for b, first, n in blocks if n > 0]
    stacked = allreduce.Local(*(
        torch.stack([getattr(b, field) if field != "rank" else torch.tensor([first]) for b, first, _ in blocks])
        for field in allreduce.Local._fields
    ))
    return stacked, [n for _, _, n in blocks]


def simulate_report(params: int, world: int, history: int) -> dict[str, float]:
    monitor = recorded_monitor(params, history)
    exchange = RankExchange.simulated(monitor._params, world)
    odd, odd_slot = world // 2, Slot.grad(params // 3).row
    started = time.perf_counter()
    for record in monitor._log.records:
        local = exchange.pack(record)
        blocks, copies = replica_blocks(local, world, odd, odd_slot)
        record.exchange = allreduce.simulate(blocks, copies=copies)
        record.groups, record.fields = [], []
    simulate_s = time.perf_counter() - started
    kept = statistics.mean(r.exchange.numel() * r.exchange.element_size() for r in monitor._log.records)
    monitor._ranks = monitor._log.ranks = exchange  # the report decodes the records through the log
    last = monitor._log.records[-1]
    started = time.perf_counter()
    exchange.decode([last])
    one_step_s = time.perf_counter() - started
    finding = last.rank_findings[Slot.at_row(odd_slot)]
    assert finding.ranks == (odd,), finding
    started = time.perf_counter()
    report = monitor.report()
    report_s = time.perf_counter() - started
    mismatches = [f for f in report.findings if f.cause == "replica_mismatch"]
    assert len(mismatches) == 1 and mismatches[0].ranks == (odd,), report
    return {"kept": kept, "report_s": report_s, "one_step_s": one_step_s, "simulate_s": simulate_s,
            "message": mismatches[0].message}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--measured-params", type=int, default=300)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sim-worlds", type=int, nargs="*", default=[8, 256, 1024, 16384])
    parser.add_argument("--params", type=int, nargs="*", default=[300, 10000])
    parser.add_argument("--history", type=int, default=64, help="records in the simulated ring (the default ring)")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")

    p = args.measured_params
    print(f"\nMeasured: gloo, DDP, P = {p} parameters, {args.steps} monitored steps, 1 thread per rank")
    print(f"{'W':>4} {'bytes received / rank / step':>29} {'calls / step':>13} {'kept / record':>14} "
          f"{'before: received = kept':>24}")
    measured = {}
    for w in args.worlds:
        m = measured[w] = measure(w, p, args.steps)
        before = w * (slot_rows(p) + 1) * 128
        print(f"{w:>4} {m['received']:>29,.0f} {m['calls']:>13.0f} {m['kept']:>14,.0f} {before:>24,}")
    if len(measured) >= 2:
        lo, hi = min(measured), max(measured)
        ratio = measured[hi]["received"] / measured[lo]["received"]
        bound = 2 * p * 320
        print(f"W={hi} / W={lo}: {ratio:.3f} (target <= 1.1); bytes {measured[hi]['received']:,.0f} vs "
              f"2P x 320 = {bound:,} (target: within it plus a constant)")

    print(f"\nSimulated: DDP replicas, one of them with a NaN in one gradient; a ring of {args.history} records")
    print(f"{'P':>6} {'W':>6} {'bytes / rank / step':>20} {'kept / record':>14} {'report() s':>11} "
          f"{'name the replica ms':>20} {'before: bytes = kept':>21}")
    for params in args.params:
        for w in args.sim_worlds:
            s = simulate_report(params, w, args.history)
            payload = allreduce.payload_bytes(slot_rows(params))
            before = w * (slot_rows(params) + 1) * 128
            print(f"{params:>6} {w:>6} {payload:>20,} {s['kept']:>14,.0f} {s['report_s']:>11.3f} "
                  f"{s['one_step_s'] * 1e3:>20.2f} {before:>21,}")
    print(f"\nThe finding at P = {args.params[-1]}, W = {args.sim_worlds[-1]}:\n  {s['message']}")
    print("Targets: kept <= 2P x 200 bytes; report() <= 0.2 s (P = 300), <= 2 s (P = 10,000) at W = 16,384; "
          "one mismatched replica named in <= 10 ms")


if __name__ == "__main__":
    main()
